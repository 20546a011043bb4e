"""The task store's local maps (memory and RocksDB) and how far they hold a changelog."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from streams.errors import ConfigError
from streams.store import local
from streams.store.local import LocalStore
from streams.store.maps import Kind, Maps
from streams.store.partition import Position


@pytest.fixture(params=["memory", "rocksdb"])
def maps(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Maps]:
    store = LocalStore(tmp_path if request.param == "rocksdb" else None, 16 << 20)
    opened = store.open(0)
    yield opened
    opened.close()


def test_rocksdb_keeps_what_was_flushed_with_its_checkpoint_and_nothing_else(
    tmp_path: Path,
) -> None:
    store = LocalStore(tmp_path, 16 << 20)
    maps = store.open(3)
    assert maps.persistent and maps.checkpoint() == dict.fromkeys(Kind, 0)
    maps.stage(Kind.RESULTS, b"rk1-a", b'{"a": 1}', 1_000)
    maps.stage(Kind.TASK_STATES, b"t1", b"state-1", 1_000)
    assert maps.get(Kind.RESULTS, b"rk1-a") == b'{"a": 1}'  # readable before the flush
    maps.flush({Kind.RESULTS: 7, Kind.TASK_STATES: 3})
    maps.stage(Kind.TASK_STATES, b"t1", b"state-2", 2_000)  # staged, never flushed: a crash
    maps.stage(Kind.TASK_STATES, b"t2", b"state-1", 2_000)
    assert maps.get(Kind.TASK_STATES, b"t1") == b"state-2"
    maps.close()

    again = store.open(3)
    assert again.get(Kind.RESULTS, b"rk1-a") == b'{"a": 1}'
    assert (
        again.get(Kind.TASK_STATES, b"t1") == b"state-1"
        and again.get(Kind.TASK_STATES, b"t2") is None
    )
    assert again.checkpoint() == {Kind.RESULTS: 7, Kind.TASK_STATES: 3, Kind.DEAD_LETTERS: 0,
                                  Kind.LEDGER: 0, Kind.SESSIONS: 0}  # fmt: skip
    assert again.count(Kind.TASK_STATES) == 1 and again.count(Kind.RESULTS) == 1
    again.close()


def test_rocksdb_writes_nothing_when_nothing_changed_since_its_last_flush(
    tmp_path: Path,
) -> None:
    """The flush loop runs every commit interval over every partition: an idle one costs
    no write, while a staged entry, a moved checkpoint or a skip is written."""
    store = LocalStore(tmp_path, 16 << 20)
    maps = store.open(1)
    assert isinstance(maps, local.RocksMaps)
    maps.flush({Kind.RESULTS: 0})  # the first flush of a handle writes (format, version)
    written = maps.sequence()
    maps.flush({Kind.RESULTS: 0})
    maps.flush({})
    assert maps.sequence() == written  # nothing new: nothing written
    maps.flush({Kind.RESULTS: 4})
    assert maps.sequence() > written
    written = maps.sequence()
    maps.stage(Kind.RESULTS, b"rk", b"{}", 1)
    maps.flush({Kind.RESULTS: 4})
    assert maps.sequence() > written and maps.get(Kind.RESULTS, b"rk") == b"{}"
    written = maps.sequence()
    maps.flush({Kind.RESULTS: 4}, skipped=True)
    assert maps.sequence() > written
    maps.close()
    again = store.open(1)
    assert again.checkpoint()[Kind.RESULTS] == 4 and again.get(Kind.RESULTS, b"rk") == b"{}"
    again.close()


def test_discard_forgets_only_the_staged_writes(maps: Maps) -> None:
    maps.stage(Kind.LEDGER, b"b1", b"committed", 1)
    maps.flush({Kind.LEDGER: 1})
    maps.stage(Kind.LEDGER, b"b2", b"aborted", 2)
    maps.discard()
    if maps.persistent:  # memory maps are dropped whole on an abort instead
        assert maps.get(Kind.LEDGER, b"b2") is None
    assert maps.get(Kind.LEDGER, b"b1") == b"committed"


def test_entries_age_by_their_last_write_and_expire_oldest_first(maps: Maps) -> None:
    def expired(kind: Kind = Kind.RESULTS, **limits: Any) -> list[bytes]:
        return [key for _, key in maps.expired(kind, **limits)]

    for i, key in enumerate([b"a", b"b", b"c", b"d"]):
        maps.stage(Kind.RESULTS, key, b"v", 1_000 + i)
    maps.stage(Kind.RESULTS, b"a", b"v2", 2_000)  # rewritten: now the newest
    maps.stage(Kind.RESULTS, b"c", None, 2_001)  # deleted
    maps.flush({Kind.RESULTS: 6})
    assert maps.count(Kind.RESULTS) == 3
    assert expired(before_ms=1_500, keep=None) == [b"b", b"d"]
    assert expired(before_ms=None, keep=1) == [b"b", b"d"]
    assert expired(before_ms=None, keep=3) == []
    assert expired(before_ms=1_002, keep=2) == [b"b"]  # either limit
    assert expired(Kind.TASK_STATES, before_ms=5_000, keep=0) == []
    assert maps.settled_at(Kind.RESULTS, b"a") == 2_000
    assert maps.settled_at(Kind.RESULTS, b"c") is None
    maps.stage(Kind.RESULTS, b"b", None, 3_000)
    maps.stage(Kind.RESULTS, b"missing", None, 3_000)  # deleting nothing counts nothing
    assert maps.settled_at(Kind.RESULTS, b"b") is None  # on its way: not to expire now
    maps.flush({Kind.RESULTS: 8})
    assert maps.count(Kind.RESULTS) == 2
    assert expired(before_ms=2_500, keep=None) == [b"d", b"a"]


def test_a_store_another_layout_wrote_or_that_skipped_records_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalStore(tmp_path, 16 << 20)
    maps = store.open(1)
    maps.stage(Kind.TASK_STATES, b"t1", b"s", 1)
    maps.flush({Kind.TASK_STATES: 1}, skipped=True)  # a record this version could not read
    maps.close()
    again = store.open(1)  # the same version: what it skipped it would skip again
    assert again.checkpoint()[Kind.TASK_STATES] == 1
    again.close()

    monkeypatch.setattr(local, "__version__", "99.0.0")  # a newer version may read it
    fresh = store.open(1)
    assert fresh.checkpoint()[Kind.TASK_STATES] == 0 and fresh.get(Kind.TASK_STATES, b"t1") is None
    fresh.stage(Kind.TASK_STATES, b"t1", b"s", 1)
    fresh.flush({Kind.TASK_STATES: 1})
    fresh.close()

    monkeypatch.setattr(local, "FORMAT", local.FORMAT + 1)  # another layout on disk
    other = store.open(1)
    assert other.checkpoint()[Kind.TASK_STATES] == 0 and other.count(Kind.TASK_STATES) == 0
    other.close()


def test_a_store_another_worker_holds_is_a_clear_error(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, 16 << 20)
    maps = store.open(2)
    with pytest.raises(ConfigError, match=r"in use by another worker.*LLM_STREAMS_DATA_DIR"):
        LocalStore(tmp_path, 16 << 20).open(2)
    maps.close()


def test_partitions_not_owned_for_long_are_stale(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, 16 << 20)
    for p in (0, 1, 2):
        store.open(p).close()
        store.release(p)
    old = time.time() - 3_600
    os.utime(store.path(1) / "last-used", (old, old))
    os.utime(store.path(2) / "last-used", (old, old))
    (tmp_path / "partition-x").mkdir()  # not ours: left alone
    (tmp_path / "partition-²").mkdir()  # a digit to isdigit, not to int: left alone too
    assert store.stale(owned={2}, idle_s=600) == [1]
    store.destroy(1)
    assert not store.path(1).exists() and store.path(0).exists()
    assert LocalStore(None).stale(owned=set(), idle_s=0) == []


def test_a_partition_held_for_long_does_not_look_idle_after_its_worker_is_killed(
    tmp_path: Path,
) -> None:
    """Its mark moves while it is held (at each flush, at most once a minute): a worker
    SIGKILLed after holding it an hour — no release — leaves a mark from just before the
    kill, not from the open, and the next worker keeps the warm copy."""
    store = LocalStore(tmp_path, 16 << 20)
    maps = store.open(3)
    old = time.time() - 3_600  # opened an hour ago
    os.utime(store.path(3) / "last-used", (old, old))
    store.in_use(3)  # a flush
    maps.close()  # SIGKILL: no release
    assert LocalStore(tmp_path, 16 << 20).stale(owned=set(), idle_s=600) == []
    os.utime(store.path(3) / "last-used", (old, old))
    store.in_use(3)  # a minute has not passed: the mark is not written again
    assert LocalStore(tmp_path, 16 << 20).stale(owned=set(), idle_s=600) == [3]


def test_the_checkpoint_never_passes_a_write_that_may_land_below_it() -> None:
    position = Position(10)  # loaded to offset 10
    first, second = position.begin(b"k1"), position.begin(b"k2")
    assert position.writing(b"k1") and not position.writing(b"k3")
    position.done(second, 11)  # acked first, though sent second
    assert position.safe() == 10  # `first` may still land at 10
    position.done(first, 10)
    assert position.safe() == 12 and not position.writing(b"k1")
    failed = position.begin(b"k3")
    position.failed(failed)  # it may be in the topic at 12 all the same
    later = position.begin(b"k4")
    position.done(later, 13)
    assert position.safe() == 12
    again = position.begin(b"k3")
    position.done(again, 14)  # the key written again: the failed write no longer counts
    assert position.safe() == 15
    unknown = position.begin(b"k5")
    position.done(unknown, None)  # acked without an offset: the top stays
    assert position.safe() == 15 and not position.writing(b"k5")


@pytest.mark.parametrize("damage", ["manifest", "tables"])
def test_a_corrupted_store_is_read_again_from_its_topics_not_a_worker_that_cannot_start(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A partition's RocksDB that no longer opens (a torn manifest, a table's bytes
    damaged: "Corruption: ... block ..." is no lock another worker holds) is deleted and
    opened empty, its checkpoint 0: the load reads its topics from the start. The error
    stopped every start of the worker until someone deleted it by hand."""
    store = LocalStore(tmp_path, 16 << 20)
    maps = store.open(4)
    for i in range(2_000):
        maps.stage(Kind.RESULTS, b"rk-%d" % i, b"v" * 100, 1_000)
        if i % 500 == 0:  # several tables
            maps.flush(dict.fromkeys(Kind, i + 1))
    maps.flush(dict.fromkeys(Kind, 2_000))
    maps.close()
    path = store.path(4)
    names = [n for n in os.listdir(path) if n.startswith("MANIFEST") or n.endswith(".sst")]
    for name in names:
        if (damage == "manifest") == name.startswith("MANIFEST"):
            raw = bytearray((path / name).read_bytes())
            for i in range(0, len(raw), 7):
                raw[i] ^= 0xFF
            (path / name).write_bytes(bytes(raw))
    again = store.open(4)
    assert again.checkpoint() == dict.fromkeys(Kind, 0) and again.get(Kind.RESULTS, b"rk-1") is None
    assert again.count(Kind.RESULTS) == 0
    assert "cannot be opened" in caplog.text and "reading its topics again" in caplog.text
    again.stage(Kind.RESULTS, b"rk-1", b"v", 2_000)  # and it takes writes again
    again.flush(dict.fromkeys(Kind, 1))
    again.close()
    assert store.open(4).get(Kind.RESULTS, b"rk-1") == b"v"


def test_a_store_that_fails_to_open_for_another_reason_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk full or out of file handles may pass: the warm copy is not thrown away for
    it (the error stops the assignment, as before)."""
    store = LocalStore(tmp_path, 16 << 20)
    maps = store.open(5)
    maps.stage(Kind.RESULTS, b"rk-1", b"v", 1_000)
    maps.flush(dict.fromkeys(Kind, 1))
    maps.close()

    def full(*args: Any, **kwargs: Any) -> None:
        raise Exception("IO error: No space left on device: While appending to file: LOG")

    real = local.RocksMaps.__init__
    monkeypatch.setattr(local.RocksMaps, "__init__", full)
    with pytest.raises(Exception, match="No space left"):
        store.open(5)
    monkeypatch.setattr(local.RocksMaps, "__init__", real)
    assert store.open(5).get(Kind.RESULTS, b"rk-1") == b"v"  # still there


def test_a_store_whose_manifest_is_gone_is_read_again(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, 16 << 20)
    store.open(6).close()
    (store.path(6) / "CURRENT").write_text("MANIFEST-999999\n")  # names a file not there
    assert store.open(6).checkpoint() == dict.fromkeys(Kind, 0)
