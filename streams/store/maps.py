"""The maps of one task partition as the task store keeps them locally (`Maps`): which
maps there are (`Kind`), and the in-memory kind (`memory://`: read again from the topics
on every assignment, as large as the history). The on-disk kind is `store.local`'s."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from enum import StrEnum
from typing import Protocol


class Kind(StrEnum):
    """The maps of the store, each backed by its own topic."""

    RESULTS = "results"
    DEAD_LETTERS = "dead_letters"
    TASK_STATES = "tasks"  # each task's state (core.taskstate); "tasks" in settings and labels
    LEDGER = "ledger"  # the batch lane's batches and their requests
    SESSIONS = "sessions"  # each session's turns (core.sessions), by session id


CODES = {kind: bytes([i + 1]) for i, kind in enumerate(Kind)}


def now_ms() -> int:
    return int(time.time() * 1000)


class Maps(Protocol):
    """One task partition's maps, as the task store keeps them locally."""

    persistent: bool  # kept across assignments and restarts (with its checkpoint)

    def get(self, kind: Kind, key: bytes) -> bytes | None: ...

    def stage(self, kind: Kind, key: bytes, value: bytes | None, at_ms: int) -> None:
        """Set (None: delete) an entry written at `at_ms`; readable at once, on disk at
        the next `flush`."""

    def flush(self, checkpoint: Mapping[Kind, int], *, skipped: bool = False) -> None:
        """Make the staged entries and `checkpoint` (per map: every changelog record
        before it is in the maps) durable together. `skipped`: records before the
        checkpoint were left out as unreadable by this version."""

    def discard(self) -> None:
        """Forget the staged entries (an aborted transaction wrote them)."""

    def unflushed(self) -> int:
        """Bytes of the staged entries (keys and values) a `flush` has not made durable."""

    def checkpoint(self) -> dict[Kind, int]: ...

    def count(self, kind: Kind) -> int: ...

    def keys(self, kind: Kind, prefix: bytes) -> list[bytes]:
        """The map's keys that start with `prefix`, staged ones included."""

    def expired(
        self, kind: Kind, before_ms: int | None, keep: int | None
    ) -> Iterator[tuple[int, bytes]]:
        """(written at, key) of the entries past the map's limits, oldest first: written
        before `before_ms`, or beyond the newest `keep` — as the maps stood when asked."""

    def settled_at(self, kind: Kind, key: bytes) -> int | None:
        """When the key's value was written, if it has one and nothing is staged for it."""

    def close(self) -> None: ...


class MemoryMaps:
    """Dicts in write order (a rewrite moves an entry to the end): the oldest first."""

    persistent = False

    def __init__(self) -> None:
        self._maps: dict[Kind, dict[bytes, tuple[int, bytes]]] = {kind: {} for kind in Kind}

    def get(self, kind: Kind, key: bytes) -> bytes | None:
        entry = self._maps[kind].get(key)
        return entry[1] if entry is not None else None

    def stage(self, kind: Kind, key: bytes, value: bytes | None, at_ms: int) -> None:
        target = self._maps[kind]
        target.pop(key, None)
        if value is not None:
            target[key] = (at_ms, value)

    def flush(self, checkpoint: Mapping[Kind, int], *, skipped: bool = False) -> None:
        return None  # nothing outlives the assignment: read again from offset 0

    def discard(self) -> None:
        return None  # the partition is dropped and read again

    def unflushed(self) -> int:
        return 0  # no disk to wait for

    def checkpoint(self) -> dict[Kind, int]:
        return dict.fromkeys(Kind, 0)

    def count(self, kind: Kind) -> int:
        return len(self._maps[kind])

    def keys(self, kind: Kind, prefix: bytes) -> list[bytes]:
        return [key for key in self._maps[kind] if key.startswith(prefix)]

    def expired(
        self, kind: Kind, before_ms: int | None, keep: int | None
    ) -> Iterator[tuple[int, bytes]]:
        target = self._maps[kind]
        entries = [(at, key) for key, (at, _) in target.items()]  # the dict changes meanwhile
        return past_entries(entries, len(target), before_ms, keep)

    def settled_at(self, kind: Kind, key: bytes) -> int | None:
        entry = self._maps[kind].get(key)
        return entry[0] if entry is not None else None

    def close(self) -> None:
        for target in self._maps.values():
            target.clear()


def past_entries(
    entries: Iterable[tuple[int, bytes]], count: int, before_ms: int | None, keep: int | None
) -> Iterator[tuple[int, bytes]]:
    """The entries (oldest first) older than `before_ms` or beyond the newest `keep`."""
    over = max(0, count - keep) if keep is not None else 0
    for i, (at, key) in enumerate(entries):
        if i >= over and (before_ms is None or at >= before_ms):
            return
        yield at, key


__all__ = ["CODES", "Kind", "Maps", "MemoryMaps", "now_ms", "past_entries"]
