"""Task state records and the content cache (single flight + LRU)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from streams.store.taskstore import Kind, readable


def test_where_the_store_lives() -> None:
    from streams.settings import load_settings
    from streams.store.taskstore import rocks_dir

    settings = load_settings()
    assert rocks_dir(settings) == settings.data_dir / "store"  # on disk by default
    assert rocks_dir(load_settings(store="memory://")) is None
    assert rocks_dir(load_settings(store="rocksdb:///srv/x")) == Path("/srv/x")


async def test_a_failed_load_is_tried_again_and_records_wait_until_it_succeeds(
    monkeypatch: Any,
) -> None:
    from streams.settings import load_settings
    from streams.store import taskstore as state_module
    from streams.store.taskstore import Kind, TaskStore

    attempts: list[int] = []

    async def flaky_load(settings: Any, topics: Any, partition: int, maps: Any, *_: Any) -> Any:
        attempts.append(partition)
        if len(attempts) < 3:
            raise OSError("broker away")
        maps.stage(Kind.RESULTS, b"rk1-x", b"{}", 1)
        return dict.fromkeys(Kind, 1)

    real_sleep = asyncio.sleep

    async def no_wait(_: float) -> None:
        await real_sleep(0)

    monkeypatch.setattr(state_module, "load_partition", flaky_load)
    monkeypatch.setattr(state_module.asyncio, "sleep", no_wait)

    async def send(*args: Any) -> None:
        return None

    store = TaskStore(load_settings(store="memory://"), send)
    store.assign({2})
    await asyncio.wait_for(store.ready(2), 5)  # waits through two failures
    assert attempts == [2, 2, 2]
    assert store.get(Kind.RESULTS, 2, b"rk1-x") == b"{}"
    await store.close()


@pytest.mark.parametrize(
    ("kind", "value", "ok"),
    [
        (Kind.TASK_STATES, b"not json", False),
        (
            Kind.TASK_STATES,
            b'{"task_id": "t1", "status": "a-newer-status", "updated_at": "x"}',
            False,
        ),
        (Kind.RESULTS, b"\xff\xfe", False),
        (Kind.RESULTS, b"[1, 2]", False),
        (Kind.RESULTS, b'{"output": "text", "model": "m"}', False),
        (Kind.RESULTS, b'{"output": {}, "model": "m", "attempts": 1, "extra": 1}', True),
        (Kind.DEAD_LETTERS, b'{"error": {"category": "timeout"}, "attempts": 2}', True),
        (Kind.DEAD_LETTERS, b'{"error": "timeout"}', False),
        (Kind.LEDGER, b'{"batch": "b1"}', True),
        (Kind.LEDGER, b"42", False),
    ],
)
def test_what_the_store_can_read(kind: Kind, value: bytes, ok: bool) -> None:
    assert readable(kind, value) is ok


@pytest.mark.parametrize("store", ["memory://", "rocksdb://"])
async def test_entries_past_their_retention_go_with_a_tombstone_unless_written_again(
    monkeypatch: Any, store: str
) -> None:
    from streams.settings import load_settings
    from streams.store import taskstore as state_module
    from streams.store.maps import now_ms
    from streams.store.taskstore import Kind, TaskStore

    async def empty(*_: Any) -> dict[Kind, int]:
        return dict.fromkeys(Kind, 0)

    monkeypatch.setattr(state_module, "load_partition", empty)
    settings = load_settings(store=store, retention={"results_days": 1, "tasks_max": 2,
                                                     "dead_letters_days": 1,
                                                     "sessions_days": 1})  # fmt: skip
    sent: list[tuple[str, bytes, bytes | None]] = []
    held = asyncio.Event()

    async def send(topic: str, key: bytes, value: bytes | None, *_: Any) -> int:
        if key == b"rk-1" and value == b"again":
            await held.wait()  # a rewrite in flight while the entries expire
        sent.append((topic, key, value))
        return len(sent) - 1

    store_ = TaskStore(settings, send)
    store_.assign({0})
    await store_.ready(0)
    for key in (b"rk-1", b"rk-2"):
        await store_.put(Kind.RESULTS, 0, key, b'{"output": {}, "model": "m"}')
    for n in range(4):
        await store_.put(Kind.TASK_STATES, 0, f"t{n}".encode(), f'{{"n": {n}}}'.encode())
    await store_.put(Kind.DEAD_LETTERS, 0, b"t9", b'{"error": {}}')
    await store_.put(Kind.LEDGER, 0, b"b1", b"{}")
    await store_.put(Kind.SESSIONS, 0, b"s1", b'{"turns": []}')  # idle for a day: it goes
    store_.committed(0)  # flushed to disk (what the flush loop does every interval)
    writing = asyncio.create_task(store_.put(Kind.RESULTS, 0, b"rk-1", b"again"))
    await asyncio.sleep(0)
    before = len(sent)

    gone = await store_.expire(0, now=now_ms() + 2 * 86_400_000)  # two days on

    assert gone == {Kind.RESULTS: 1, Kind.TASK_STATES: 2, Kind.DEAD_LETTERS: 1, Kind.LEDGER: 0,
                    Kind.SESSIONS: 1}  # fmt: skip
    tombstones = sent[before:]
    assert sorted((t, k) for t, k, v in tombstones if v is None) == sorted([
        (settings.topics.results, b"rk-2"),
        (store_.topics[Kind.TASK_STATES], b"t0"), (store_.topics[Kind.TASK_STATES], b"t1"),
        (store_.topics[Kind.SESSIONS], b"s1"),
    ])  # fmt: skip  # the dead-letter topic is not compacted: no tombstone there
    assert len(tombstones) == 4
    assert store_.get(Kind.RESULTS, 0, b"rk-2") is None
    assert store_.get(Kind.DEAD_LETTERS, 0, b"t9") is None
    assert [store_.get(Kind.TASK_STATES, 0, f"t{n}".encode()) is not None for n in range(4)] == [
        False, False, True, True]  # fmt: skip  # the newest two
    assert store_.get(Kind.LEDGER, 0, b"b1") == b"{}"  # 7 days
    held.set()
    await writing
    assert store_.get(Kind.RESULTS, 0, b"rk-1") == b"again"  # its rewrite was not expired
    await store_.close()


async def test_jobs_waiting_on_a_partition_given_away_while_it_loads_are_told(
    monkeypatch: Any,
) -> None:
    """Dropped (exactly-once, after a fence) or revoked while it loads: its waiters hear
    PartitionLost at once — before, they waited forever, holding their in-order tickets
    and the next rebalance — and a partition not this worker's is not loaded for them
    (its writes would be thrown away): they are told the same."""
    from streams.settings import load_settings
    from streams.store import taskstore as state_module
    from streams.store.taskstore import PartitionLost, TaskStore

    loading = asyncio.Event()

    async def slow_load(*_: Any) -> Any:
        loading.set()
        await asyncio.Event().wait()  # the broker slow to answer

    monkeypatch.setattr(state_module, "load_partition", slow_load)

    async def send(*args: Any) -> None:
        return None

    store = TaskStore(load_settings(store="memory://"), send)
    store.assign({1, 2})
    waiting = [asyncio.create_task(store.ready(p)) for p in (1, 1, 2)]
    await loading.wait()
    store.drop(1)  # a fence, while partition 1 loads
    store.assign({2})
    for task in waiting[:2]:
        with pytest.raises(PartitionLost):
            await asyncio.wait_for(task, 5)
    assert not waiting[2].done()
    with pytest.raises(PartitionLost):
        await store.ready(1)  # queued after the fence: not loaded again for it
    assert store.owned() == {2}
    await store.close()
    with pytest.raises(PartitionLost):
        await asyncio.wait_for(waiting[2], 5)  # closed: told, not left waiting


async def test_a_record_ahead_of_its_partitions_assignment_is_loaded_for_not_refused(
    monkeypatch: Any,
) -> None:
    """Exactly-once starts a partition's producer before the store hears of the partition:
    its first records come first. They are this worker's (the rebalance said so): the
    partition is loaded for them, not taken for given away — which left them unacked
    and the partition stuck until the next rebalance."""
    from streams.settings import load_settings
    from streams.store import taskstore as state_module
    from streams.store.taskstore import PartitionLost, TaskStore

    async def empty(*_: Any) -> dict[Kind, int]:
        return dict.fromkeys(Kind, 0)

    monkeypatch.setattr(state_module, "load_partition", empty)

    async def send(*args: Any) -> None:
        return None

    store = TaskStore(load_settings(store="memory://"), send)
    store.assign({0, 1})
    store.assign({0})  # 1 given away
    with pytest.raises(PartitionLost):
        await store.ready(1)
    store.arriving({1, 3})  # the next rebalance gives 1 back, and 3
    await asyncio.wait_for(store.ready(1), 5)
    await asyncio.wait_for(store.ready(3), 5)
    assert store.owned() == {0, 1, 3}
    await store.close()


class _Follower:
    """follow_partition's stand-in: stages `entries`, makes them durable at `offset`, then
    follows until cancelled; records the checkpoint each call began from."""

    def __init__(self, entries: dict[bytes, bytes], offset: int) -> None:
        self.entries, self.offset = entries, offset
        self.began: list[dict[Kind, int]] = []
        self.following = asyncio.Event()
        self.started: asyncio.Queue[int] = asyncio.Queue()  # partitions, as each begins
        self.stopped = 0

    async def __call__(self, settings: Any, topics: Any, partition: int, maps: Any,
                       on_unreadable: Any, on_flush: Any) -> None:  # fmt: skip
        self.began.append(maps.checkpoint())
        for key, value in self.entries.items():
            maps.stage(Kind.RESULTS, key, value, 1)
        maps.flush(dict.fromkeys(Kind, self.offset))
        on_flush(len(self.entries))
        maps.stage(Kind.RESULTS, b"rk-unflushed", b"{}", 1)  # staged after the last flush
        self.following.set()
        self.started.put_nowait(partition)
        try:
            await asyncio.Event().wait()
        finally:
            self.stopped += 1


async def test_a_standby_taken_over_opens_its_warm_copy_and_reads_only_what_came_after(
    monkeypatch: Any, tmp_path: Path
) -> None:
    """The partition a worker stands by for is followed into its on-disk copy; assigned,
    its follower stops and lets the copy go before the active partition opens it (one
    RocksDB, one lock), and the load starts at the standby's checkpoint: a takeover reads
    only what the follower had not read yet. What the follower staged after its last
    flush is not taken for durable."""
    from streams.settings import load_settings
    from streams.store import taskstore as state_module
    from streams.store.taskstore import TaskStore

    follower = _Follower({b"rk-old": b'{"output": {}, "model": "m"}'}, offset=40)
    loaded_from: list[dict[Kind, int]] = []

    async def load(settings: Any, topics: Any, partition: int, maps: Any, *_: Any) -> Any:
        loaded_from.append(maps.checkpoint())
        return dict.fromkeys(Kind, 0)

    monkeypatch.setattr(state_module, "follow_partition", follower)
    monkeypatch.setattr(state_module, "load_partition", load)

    async def send(*args: Any) -> None:
        return None

    store = TaskStore(load_settings(store=f"rocksdb://{tmp_path}"), send)
    store.assign({0})
    store.standby({0, 1})  # its own partition aside
    assert store.standing_by() == {1}
    await asyncio.wait_for(follower.following.wait(), 5)
    assert store.metrics.store_standbys._value.get() == 1
    assert store.metrics.standby_records._value.get() == 1

    store.assign({0, 1})  # the owner of 1 left: promoted
    await asyncio.wait_for(store.ready(1), 5)
    assert store.standing_by() == set()
    assert loaded_from[-1] == dict.fromkeys(Kind, 40)
    assert store.get(Kind.RESULTS, 1, b"rk-old") == b'{"output": {}, "model": "m"}'
    assert store.get(Kind.RESULTS, 1, b"rk-unflushed") is None
    await asyncio.sleep(0)
    assert follower.stopped == 1
    assert store.metrics.store_standbys._value.get() == 0
    await store.close()


async def test_standbys_given_away_stop_keep_their_copy_and_are_not_cleaned_up_while_followed(
    monkeypatch: Any, tmp_path: Path
) -> None:
    from streams.settings import load_settings
    from streams.store import taskstore as state_module
    from streams.store.local import LocalStore
    from streams.store.taskstore import TaskStore

    follower = _Follower({b"rk-1": b"{}"}, offset=3)

    async def empty(*_: Any) -> dict[Kind, int]:
        return dict.fromkeys(Kind, 0)

    monkeypatch.setattr(state_module, "follow_partition", follower)
    monkeypatch.setattr(state_module, "load_partition", empty)

    async def send(*args: Any) -> None:
        return None

    # Cleaned up at once when not owned: only being followed keeps a copy.
    settings = load_settings(store=f"rocksdb://{tmp_path}", store_cleanup_after_s=0)
    store = TaskStore(settings, send)
    store.standby({1, 2})
    for _ in range(2):
        await asyncio.wait_for(follower.started.get(), 5)
    store.assign({0})
    assert store.local.path(1).exists() and store.local.path(2).exists()

    store.standby({2})  # 1 is no longer this worker's to stand by for
    await asyncio.sleep(0)
    assert follower.stopped == 1 and store.standing_by() == {2}
    assert store.local.path(1).exists()  # kept, for store_cleanup_after_s

    await store.close()  # stops the followers still running
    assert follower.stopped == 2 and store.standing_by() == set()
    local = LocalStore(tmp_path)
    maps = local.open(2)  # closed: its lock is free, and its copy is what was flushed
    assert maps.checkpoint() == dict.fromkeys(Kind, 3)
    assert maps.get(Kind.RESULTS, b"rk-1") == b"{}"
    maps.close()


@pytest.mark.parametrize("why", ["ahead", "damaged"])
async def test_a_standby_ahead_of_its_topics_follows_them_again_from_the_start(
    monkeypatch: Any, tmp_path: Path, why: str
) -> None:
    """follow_partition returns when the copy is ahead of its topics (made again), and
    raises RocksDB's Corruption when it is damaged: the copy goes and is followed from
    offset 0, not left stale and not retried as it is."""
    from streams.settings import load_settings
    from streams.store import taskstore as state_module
    from streams.store.local import LocalStore
    from streams.store.taskstore import TaskStore

    old = LocalStore(tmp_path).open(1)
    old.stage(Kind.RESULTS, b"rk-gone", b"{}", 1)
    old.flush(dict.fromkeys(Kind, 900))
    old.close()
    follower = _Follower({}, offset=0)
    calls: list[dict[Kind, int]] = []

    async def follow(settings: Any, topics: Any, partition: int, maps: Any, *rest: Any) -> None:
        calls.append(maps.checkpoint())
        if len(calls) == 1 and why == "ahead":
            return  # ahead of its topics
        if len(calls) == 1:
            raise Exception("Corruption: block checksum mismatch")
        assert maps.get(Kind.RESULTS, b"rk-gone") is None
        await follower(settings, topics, partition, maps, *rest)

    real_sleep = asyncio.sleep

    async def no_wait(_: float) -> None:
        await real_sleep(0)

    monkeypatch.setattr(state_module, "follow_partition", follow)
    monkeypatch.setattr(state_module.asyncio, "sleep", no_wait)

    async def send(*args: Any) -> None:
        return None

    store = TaskStore(load_settings(store=f"rocksdb://{tmp_path}"), send)
    store.standby({1})
    await asyncio.wait_for(follower.following.wait(), 5)
    assert calls == [dict.fromkeys(Kind, 900), dict.fromkeys(Kind, 0)]
    await store.close()


def test_standbys_need_an_on_disk_store() -> None:
    from streams.errors import ConfigError
    from streams.settings import load_settings

    assert load_settings(store_standby_replicas=1).store_standby_replicas == 1
    with pytest.raises(ConfigError, match=r"settings: LLM_STREAMS_STORE_STANDBY_REPLICAS needs"):
        load_settings(store="memory://", store_standby_replicas=1)


async def test_standing_by_with_a_memory_store_is_nothing() -> None:
    from streams.settings import load_settings
    from streams.store.taskstore import TaskStore

    async def send(*args: Any) -> None:
        return None

    store = TaskStore(load_settings(store="memory://"), send)
    store.standby({1})
    assert store.standing_by() == set()
    await store.close()


async def test_a_standby_whose_broker_goes_away_follows_again_once_it_is_back(
    monkeypatch: Any, tmp_path: Path
) -> None:
    from streams.settings import load_settings
    from streams.store import taskstore as state_module
    from streams.store.taskstore import TaskStore

    follower = _Follower({b"rk-1": b"{}"}, offset=5)
    failures: list[int] = []

    async def follow(settings: Any, topics: Any, partition: int, maps: Any, *rest: Any) -> None:
        if len(failures) < 2:
            failures.append(partition)
            raise OSError("broker away")
        await follower(settings, topics, partition, maps, *rest)

    real_sleep = asyncio.sleep

    async def no_wait(_: float) -> None:
        await real_sleep(0)

    monkeypatch.setattr(state_module, "follow_partition", follow)
    monkeypatch.setattr(state_module.asyncio, "sleep", no_wait)

    async def send(*args: Any) -> None:
        return None

    store = TaskStore(load_settings(store=f"rocksdb://{tmp_path}"), send)
    store.standby({3})
    await asyncio.wait_for(follower.following.wait(), 5)
    assert failures == [3, 3] and store.standing_by() == {3}
    assert store.metrics.standby_records._value.get() == 1
    await store.close()
    assert follower.stopped == 1


async def test_the_flusher_sleeps_while_nothing_is_written(
    monkeypatch: Any, tmp_path: Path
) -> None:
    """What a partition was written goes to disk within a commit interval; while nothing
    is written the flusher does not wake (an idle worker woke twice a second for it), but
    for the partitions' last-used marks, every `MARK_EVERY_S`."""
    from streams.settings import load_settings
    from streams.store import taskstore as state_module
    from streams.store.local import LocalStore
    from streams.store.taskstore import TaskStore

    async def empty(*_: Any) -> dict[Kind, int]:
        return dict.fromkeys(Kind, 0)

    monkeypatch.setattr(state_module, "load_partition", empty)
    monkeypatch.setattr(state_module, "MARK_EVERY_S", 0.5)
    flushes: list[int] = []
    real_flush = TaskStore._flush
    monkeypatch.setattr(TaskStore, "_flush",
                        lambda self, p, part: (flushes.append(p), real_flush(self, p, part)))  # fmt: skip

    async def send(*args: Any) -> int:
        return 7

    store = TaskStore(load_settings(store=f"rocksdb://{tmp_path}", kafka={"commit_interval_s": 0.01}),
                      send)  # fmt: skip
    store.assign({0})
    await store.ready(0)
    await asyncio.sleep(0.2)  # twenty intervals, nothing written
    assert flushes == []
    await store.put(Kind.RESULTS, 0, b"rk-1", b'{"output": {}, "model": "m"}')
    await asyncio.sleep(0.1)
    assert flushes == [0]  # once, not once an interval since
    await asyncio.sleep(0.6)
    assert flushes == [0, 0]  # the mark's wake-up
    await store.close()
    local = LocalStore(tmp_path, 8 << 20)
    maps = local.open(0)  # what reached the disk
    assert maps.get(Kind.RESULTS, b"rk-1") == b'{"output": {}, "model": "m"}'
    assert maps.checkpoint()[Kind.RESULTS] == 8
    local.release(0)


def _over_empty_topics(monkeypatch: Any, send: Any = None, **settings: Any) -> Any:
    """A TaskStore whose partitions load from empty topics, writing through `send`
    (default: every write acked at offset 0)."""
    from streams.settings import load_settings
    from streams.store import taskstore as state_module
    from streams.store.taskstore import TaskStore

    async def empty(*_: Any) -> dict[Kind, int]:
        return dict.fromkeys(Kind, 0)

    async def acked(*_: Any) -> int:
        return 0

    monkeypatch.setattr(state_module, "load_partition", empty)
    return TaskStore(load_settings(**settings), send or acked)


async def _on_a_refusing_disk(
    monkeypatch: Any, tmp_path: Path, **settings: Any
) -> tuple[Any, dict[str, bool]]:
    """A store on disk whose flushes fail while `disk["full"]`, as a full volume's do."""
    from streams.store.local import RocksMaps

    disk = {"full": True}
    real_flush = RocksMaps.flush

    def flush(self: Any, checkpoint: Any, **kwargs: Any) -> None:
        if disk["full"]:
            raise OSError(28, "No space left on device")
        real_flush(self, checkpoint, **kwargs)

    monkeypatch.setattr(RocksMaps, "flush", flush)
    offsets = iter(range(1_000_000))

    async def send(*args: Any) -> int:
        return next(offsets)

    store = _over_empty_topics(monkeypatch, send, store=f"rocksdb://{tmp_path}",
                               kafka={"commit_interval_s": 0.01}, **settings)  # fmt: skip
    store.assign({0, 1})
    await store.ready(0)
    await store.ready(1)
    return store, disk


async def test_records_wait_while_the_writes_a_full_disk_refused_pass_their_bound(
    monkeypatch: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The disk refuses the store's writes: they stay in memory, and past
    `store_unflushed_mb` records wait before they run (memory grew with every task until
    the worker was killed); once the disk takes them, the records go on and the writes are
    on disk."""
    store, disk = await _on_a_refusing_disk(monkeypatch, tmp_path, store_unflushed_mb=1)
    value = b'{"output": "' + b"x" * 300_000 + b'", "model": "m"}'
    await store.put(Kind.RESULTS, 0, b"rk-1", value)
    await asyncio.sleep(0.05)  # flushes failed: under the bound, records still run
    assert store.metrics.store_flush_errors._value.get() >= 1
    await asyncio.wait_for(store.ready(0), 1)
    for n in range(2, 6):
        await store.put(Kind.RESULTS, n % 2, b"rk-%d" % n, value)
    await asyncio.sleep(0.05)  # the next flush fails past the bound
    assert store.metrics.store_unflushed._value.get() > 1 << 20
    waiting = [asyncio.create_task(store.ready(p)) for p in (0, 1)]
    await asyncio.sleep(0.1)  # ten more intervals, ten more failed flushes
    assert not any(task.done() for task in waiting) and store.disk_refusing()  # not ready
    assert store.metrics.store_flush_errors._value.get() >= 20
    assert caplog.text.count("could not write the local store") == 1  # said once a minute
    assert store.get(Kind.RESULTS, 1, b"rk-3") == value  # what it holds is still read
    disk["full"] = False
    await asyncio.wait_for(asyncio.gather(*waiting), 5)
    assert store.metrics.store_unflushed._value.get() == 0 and not store.disk_refusing()
    await store.close()
    from streams.store.local import LocalStore

    local = LocalStore(tmp_path, 8 << 20)
    maps = local.open(1)
    assert maps.get(Kind.RESULTS, b"rk-3") == value  # on disk now
    maps.close()


async def test_a_record_waiting_for_a_full_disk_hears_its_partition_was_given_away(
    monkeypatch: Any, tmp_path: Path
) -> None:
    from streams.store.taskstore import PartitionLost

    store, _ = await _on_a_refusing_disk(monkeypatch, tmp_path, store_unflushed_mb=1)
    value = b'{"output": "' + b"x" * 600_000 + b'", "model": "m"}'
    await store.put(Kind.RESULTS, 0, b"rk-1", value)
    await store.put(Kind.RESULTS, 1, b"rk-2", value)
    await asyncio.sleep(0.05)
    waiting = asyncio.create_task(store.ready(1))
    kept = asyncio.create_task(store.ready(0))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    store.assign({0})  # partition 1 given away: its writes go with it, back under the bound
    with pytest.raises(PartitionLost):
        await asyncio.wait_for(waiting, 1)
    await asyncio.wait_for(kept, 1)  # 0.6 MB left: its records go on
    await store.close()


async def test_a_write_refused_for_good_does_not_hold_the_checkpoint(monkeypatch: Any) -> None:
    """A result the topic refuses (too large) is not in it, and its key is never written
    again (the task's dead letter goes elsewhere): held as a write that may have landed,
    it kept the local checkpoint there until the worker restarted, which then read the
    partition again from it. A write that may have landed (timed out) still holds it."""
    from aiokafka.errors import KafkaTimeoutError, RecordTooLargeError

    offsets = iter(range(100))
    refusals = {b"rk-big": RecordTooLargeError(), b"rk-late": KafkaTimeoutError()}

    async def send(topic: str, key: bytes, *args: Any) -> int:
        if key in refusals:
            raise refusals.pop(key)
        return next(offsets)

    store = _over_empty_topics(monkeypatch, send, store="memory://")
    store.assign({0})
    await store.ready(0)
    part = store._parts[0]
    try:
        await store.put(Kind.RESULTS, 0, b"rk-1", b"{}")  # offset 0
        with pytest.raises(RecordTooLargeError):
            await store.put(Kind.RESULTS, 0, b"rk-big", b"{}")
        await store.put(Kind.RESULTS, 0, b"rk-2", b"{}")  # offset 1
        assert part.checkpoint()[Kind.RESULTS] == 2  # past the refused write
        with pytest.raises(KafkaTimeoutError):
            await store.put(Kind.RESULTS, 0, b"rk-late", b"{}")  # may be at 2 all the same
        await store.put(Kind.RESULTS, 0, b"rk-3", b"{}")  # offset 2
        assert part.checkpoint()[Kind.RESULTS] == 2
    finally:
        await store.close()


async def test_the_store_closes_right_after_a_write(monkeypatch: Any, tmp_path: Path) -> None:
    """A write wakes the flusher; a close in the same turn of the loop cancelled it just
    as its wait ended, which Python 3.11's `wait_for` swallows: the flusher went on
    looping and the close (the worker's stop) hung on it."""
    store = _over_empty_topics(monkeypatch, store=f"rocksdb://{tmp_path}")
    store.assign({0})
    await store.ready(0)
    await asyncio.sleep(0.01)  # the flusher waits for a write
    await store.put(Kind.RESULTS, 0, b"rk-1", b"{}")
    await asyncio.wait_for(store.close(), 5)


async def test_a_local_copy_found_damaged_on_a_read_or_a_flush_is_dropped_and_started_again(
    monkeypatch: Any, tmp_path: Path
) -> None:
    """A block that fails its checksum is found on a read, not at the open: every record's
    read of it failed (a dead letter as a bug each) and every flush too (retried as a full
    disk, until records waited for good). The copy is dropped and deleted, the read says
    PartitionLost (the record runs again), and the worker is told to start the partition
    again; a flush that finds it does the same."""
    from streams.store.local import RocksMaps
    from streams.store.taskstore import PartitionLost

    store = _over_empty_topics(monkeypatch, store=f"rocksdb://{tmp_path}")
    restarted: list[int] = []

    async def on_damaged(p: int) -> None:
        restarted.append(p)

    store.on_damaged = on_damaged
    store.assign({0, 1})
    await store.ready(0)
    await store.ready(1)
    try:
        bad = Exception("Corruption: block checksum mismatch: stored = 1, computed = 2")

        def broken(*_: Any) -> Any:
            raise bad

        monkeypatch.setattr(store._parts[0].maps, "get", broken)
        with pytest.raises(PartitionLost) as caught:
            store.get(Kind.RESULTS, 0, b"rk-1")
        assert caught.value.__cause__ is bad
        await asyncio.sleep(0)
        assert restarted == [0] and store.owned() == {1}
        assert not store.local.path(0).exists()  # read again from its topics when assigned
        with pytest.raises(PartitionLost):
            await store.ready(0)
        monkeypatch.setattr(RocksMaps, "flush", lambda self, *_, **__: broken())
        await store.put(Kind.RESULTS, 1, b"rk-2", b"{}")
        store.committed(1)  # the flush meets it
        await asyncio.sleep(0)
        assert restarted == [0, 1] and store.owned() == set()
        assert store.metrics.store_flush_errors._value.get() == 0  # no disk refusing
    finally:
        await store.close()
