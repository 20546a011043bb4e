"""The task store's local copy of one task partition's maps: in memory (`memory://`,
`store.maps.MemoryMaps`: read again from the topics on every assignment) or on disk
(`rocksdb://`, the default: RocksDB through rocksdict), where it outlives the process with
the changelog offsets it holds, so an assignment reads only what the topics gained
since (incremental recovery, as Kafka Streams' and Faust's stores do).

On disk, a partition is one RocksDB: a column family per map, one for the age index (map,
write time, key: the oldest entries first, for retention) and one for the checkpoint
(per map, the next changelog offset to read) and the entry counts. Writes wait in
`staged` (memory) until `flush`, which writes them with the checkpoint in one WriteBatch:
the checkpoint never says more than the maps hold, whatever kills the process, and
exactly-once flushes only what a committed transaction wrote (an aborted one never
reaches the disk).

Memory is bounded by the settings, not the history: every partition's blocks and
memtables share one LRU cache (`store_cache_mb`, the memtables charged to it).

Hand-written because neither Faust (its RocksDB tables keep no age index, and their
recovery is what `store.taskstore` avoids) nor rocksdict (a mapping) keeps a checkpoint
atomically with the data, an age order and counts per map.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import struct
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, cast

from streams import __version__
from streams.errors import ConfigError
from streams.store.maps import CODES, Kind, Maps, MemoryMaps, past_entries

log = logging.getLogger(__name__)

FORMAT = 1  # the on-disk layout; a store of another format is read again from the topics
_U64 = struct.Struct(">Q")
# The meta family's keys per map, made once (a flush writes them all).
_CHECKPOINT_KEYS = {kind: b"checkpoint/" + kind.value.encode() for kind in Kind}
_COUNT_KEYS = {kind: b"count/" + kind.value.encode() for kind in Kind}


# -- RocksDB ------------------------------------------------------------------------------


class RocksMaps:
    """One partition's RocksDB (see the module's docstring for its layout)."""

    persistent = True
    META, AGES = "meta", "ages"

    def __init__(self, path: Path, options: Any, families: dict[str, Any]) -> None:
        from rocksdict import Rdict

        self.path = path
        try:
            self._db = Rdict(str(path), options=options, column_families=families)
        except Exception as exc:
            # RocksDB names the lock file it could not take ("While lock file: .../LOCK",
            # "lock hold by current process ... /LOCK"); "lock" alone is in "block
            # checksum mismatch", a corruption.
            if str(path / "LOCK") in str(exc):
                raise ConfigError(
                    f"the task store at {path} is in use by another worker: give each worker "
                    f"its own LLM_STREAMS_DATA_DIR (or LLM_STREAMS_STORE path) ({exc})"
                ) from exc
            raise
        self._cf = {name: self._db.get_column_family(name) for name in families}
        self._handles = {name: self._db.get_column_family_handle(name) for name in families}
        self._staged: dict[tuple[Kind, bytes], tuple[int, bytes | None]] = {}
        self._staged_bytes = 0  # their keys and values
        # The checkpoint on disk, once this handle wrote it (the format and version with it).
        self._flushed: dict[Kind, int] | None = None
        meta = self._cf[self.META]
        self._counts = {kind: _int(meta.get(_COUNT_KEYS[kind])) for kind in Kind}

    # reads

    def get(self, kind: Kind, key: bytes) -> bytes | None:
        staged = self._staged.get((kind, key))
        if staged is not None:
            return staged[1]
        raw = self._cf[kind].get(key)
        return raw[8:] if raw is not None else None

    def checkpoint(self) -> dict[Kind, int]:
        meta = self._cf[self.META]
        return {kind: _int(meta.get(_CHECKPOINT_KEYS[kind])) for kind in Kind}

    def count(self, kind: Kind) -> int:
        return self._counts[kind]

    def sequence(self) -> int:
        """RocksDB's sequence number: it moves with every write this copy takes."""
        return int(self._db.latest_sequence_number())

    def keys(self, kind: Kind, prefix: bytes) -> list[bytes]:
        found: set[bytes] = set()
        for item in self._cf[kind].keys(from_key=prefix):
            key = cast(bytes, item)
            if not key.startswith(prefix):
                break
            found.add(key)
        for (staged_kind, key), (_, value) in self._staged.items():
            if staged_kind is kind and key.startswith(prefix):
                if value is None:
                    found.discard(key)
                else:
                    found.add(key)
        return sorted(found)

    def usable(self) -> bool:
        """Written in this layout, and not missing records this version can read that the
        version which wrote it skipped (a rolling upgrade back and forth)."""
        meta = self._cf[self.META]
        fmt, version = meta.get(b"format"), meta.get(b"version")
        if fmt is None:
            return True  # new
        return _int(fmt) == FORMAT and (version == __version__.encode() or not meta.get(b"skipped"))

    def expired(
        self, kind: Kind, before_ms: int | None, keep: int | None
    ) -> Iterator[tuple[int, bytes]]:
        # A RocksDB iterator reads one snapshot: flushes meanwhile do not move it.
        return past_entries(self._ages(kind), self._counts[kind], before_ms, keep)

    def settled_at(self, kind: Kind, key: bytes) -> int | None:
        if (kind, key) in self._staged:
            return None
        raw = self._cf[kind].get(key)
        return _int(raw[:8]) if raw is not None else None

    def _ages(self, kind: Kind) -> Iterator[tuple[int, bytes]]:
        code = CODES[kind]
        for item in self._cf[self.AGES].keys(from_key=code):
            index_key = cast(bytes, item)
            if index_key[:1] != code:
                return
            yield _int(index_key[1:9]), index_key[9:]

    # writes

    def stage(self, kind: Kind, key: bytes, value: bytes | None, at_ms: int) -> None:
        before = self._staged.get((kind, key))
        if before is not None:
            self._staged_bytes -= len(key) + len(before[1] or b"")
        self._staged[(kind, key)] = (at_ms, value)
        self._staged_bytes += len(key) + len(value or b"")

    def discard(self) -> None:
        self._staged.clear()
        self._staged_bytes = 0

    def unflushed(self) -> int:
        return self._staged_bytes

    def flush(self, checkpoint: Mapping[Kind, int], *, skipped: bool = False) -> None:
        from rocksdict import WriteBatch

        flushed = self._flushed
        if (
            not self._staged
            and not skipped
            and flushed is not None
            and all(flushed.get(kind) == offset for kind, offset in checkpoint.items())
        ):
            return  # on disk already: an idle partition costs no write every interval
        batch = WriteBatch(raw_mode=True)
        ages = self._handles[self.AGES]
        counts = dict(self._counts)
        for (kind, key), (at, value) in self._staged.items():
            handle = self._handles[kind]
            before = self._cf[kind].get(key)
            if before is not None:  # its age entry moves (or goes)
                batch.delete(CODES[kind] + before[:8] + key, ages)
                counts[kind] -= 1
            if value is None:
                if before is not None:
                    batch.delete(key, handle)
                continue
            stamp = _U64.pack(max(0, at))
            batch.put(key, stamp + value, handle)
            batch.put(CODES[kind] + stamp + key, b"", ages)
            counts[kind] += 1
        meta = self._handles[self.META]
        for kind, offset in checkpoint.items():
            batch.put(_CHECKPOINT_KEYS[kind], _U64.pack(offset), meta)
        for kind, n in counts.items():
            batch.put(_COUNT_KEYS[kind], _U64.pack(n), meta)
        batch.put(b"format", _U64.pack(FORMAT), meta)
        batch.put(b"version", __version__.encode(), meta)
        if skipped:
            batch.put(b"skipped", b"1", meta)
        self._db.write(batch)
        self._counts = counts
        self._staged.clear()
        self._staged_bytes = 0
        self._flushed = {**(flushed or {}), **checkpoint}

    def close(self) -> None:
        self.discard()
        for family in self._cf.values():
            family.close()
        self._cf.clear()
        self._handles.clear()
        self._db.close()


def damaged(exc: BaseException) -> bool:
    """RocksDB says its files are damaged or missing (a table, a manifest) — what no
    retry mends — rather than a failure of the disk or the process (full, read-only, out
    of file handles), which may pass."""
    said = str(exc)
    return said.startswith("Corruption") or "No such file or directory" in said


def _int(raw: bytes | None) -> int:
    return _U64.unpack(raw)[0] if raw is not None else 0


# How often an owned partition's last-used mark moves (far below store_cleanup_after_s).
MARK_EVERY_S = 60.0


class LocalStore:
    """Opens the partitions' maps: in memory, or RocksDB files under `base` sharing one
    cache of `cache_bytes` (blocks and memtables)."""

    def __init__(self, base: Path | None, cache_bytes: int = 64 << 20) -> None:
        self.base = base
        self.cache_bytes = cache_bytes
        self._options: tuple[Any, dict[str, Any]] | None = None
        self._marked: dict[int, float] = {}  # partition -> when its mark last moved

    def open(self, partition: int) -> Maps:
        if self.base is None:
            return MemoryMaps()
        path = self.path(partition)
        path.mkdir(parents=True, exist_ok=True)
        options, families = self._rocks_options()
        try:
            maps = RocksMaps(path, options, families)
        except ConfigError:
            raise  # another worker's
        except Exception as exc:
            if not damaged(exc):
                raise  # a disk full, out of file handles...: no reason to lose the copy
            # Corrupted (a torn write, a disk that failed): as Kafka Streams does with a
            # corrupted task's state, it goes and its topics are read again, where the
            # error would stop every start of the worker until someone deleted it.
            log.error("the local store of partition %d cannot be opened (%s): deleting it "
                      "and reading its topics again", partition, exc)  # fmt: skip
            self.destroy(partition)
            path.mkdir(parents=True, exist_ok=True)
            maps = RocksMaps(path, options, families)
        if not maps.usable():  # read it all again from the topics
            maps.close()
            self.destroy(partition)
            path.mkdir(parents=True, exist_ok=True)
            maps = RocksMaps(path, options, families)
        (path / "last-used").touch()
        return maps

    def path(self, partition: int) -> Path:
        assert self.base is not None
        return self.base / f"partition-{partition}"

    def destroy(self, partition: int) -> None:
        """Delete a partition's files (it is read again from its topics when assigned)."""
        if self.base is not None:
            shutil.rmtree(self.path(partition), ignore_errors=True)

    def stale(self, owned: set[int], idle_s: float) -> list[int]:
        """Partitions on disk this worker has not owned for `idle_s` seconds."""
        if self.base is None or not self.base.exists():
            return []
        found: list[int] = []
        for path in self.base.glob("partition-*"):
            number = path.name.removeprefix("partition-")
            if not (number.isascii() and number.isdigit()) or int(number) in owned:
                continue
            used = path / "last-used"
            since = used.stat().st_mtime if used.exists() else 0.0
            if time.time() - since >= idle_s:
                found.append(int(number))
        return sorted(found)

    def release(self, partition: int) -> None:
        """The partition left this worker: its idle time counts from now."""
        if self.base is not None and self.path(partition).exists():
            (self.path(partition) / "last-used").touch()
        self._marked.pop(partition, None)

    def in_use(self, partition: int) -> None:
        """The partition is this worker's still (told at each flush): its mark moves, at
        most once a minute, so that after a SIGKILL — no release — a partition held for
        hours does not look idle since it was opened and get its warm copy deleted."""
        now = time.monotonic()
        if self.base is None or now - self._marked.get(partition, -MARK_EVERY_S) < MARK_EVERY_S:
            return
        self._marked[partition] = now
        with contextlib.suppress(OSError):  # gone meanwhile: the next open makes it again
            (self.path(partition) / "last-used").touch()

    def _rocks_options(self) -> tuple[Any, dict[str, Any]]:
        if self._options is None:
            from rocksdict import (
                BlockBasedOptions,
                Cache,
                DBCompressionType,
                Options,
                WriteBufferManager,
            )

            cache = Cache(self.cache_bytes)
            # Memtables count against the same cache: half of it at most.
            buffers = WriteBufferManager.new_write_buffer_manager_with_cache(
                self.cache_bytes // 2, False, cache
            )

            def options() -> Any:
                opts = Options(raw_mode=True)  # keys and values are our bytes, not pickles
                opts.create_if_missing(True)
                opts.create_missing_column_families(True)
                table = BlockBasedOptions()
                table.set_block_cache(cache)
                table.set_cache_index_and_filter_blocks(True)
                table.set_bloom_filter(10, False)
                opts.set_block_based_table_factory(table)
                opts.set_write_buffer_manager(buffers)
                opts.set_write_buffer_size(8 << 20)
                opts.set_max_write_buffer_number(2)
                opts.set_keep_log_file_num(2)
                opts.set_max_open_files(256)
                # JSON compresses well; files full of deletions (expired entries) are
                # compacted soon, so the disk shrinks with retention.
                opts.set_compression_type(DBCompressionType.lz4())
                opts.add_compact_on_deletion_collector_factory(10_000, 5_000, 0.5)
                return opts

            names = [*(kind.value for kind in Kind), RocksMaps.META, RocksMaps.AGES]
            self._options = (options(), {name: options() for name in names})
        return self._options


__all__ = ["FORMAT", "LocalStore", "RocksMaps", "damaged"]
