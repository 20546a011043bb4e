"""Task state records and the content cache (single flight + LRU)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest

from streams.contract.records import Source
from streams.kafka.store import HISTORY_LIMIT, ContentCache, Kind, Status, TaskState, readable


def test_state_round_trips_and_keeps_a_bounded_history() -> None:
    state = TaskState(task_id="t1", status=Status.RECEIVED, updated_at="")
    for i in range(HISTORY_LIMIT + 5):
        state = state.moved(
            Status.SUCCEEDED, prompt_version=f"v{i}", result_key=f"rk1-{i}",
            source=Source(topic="t", partition=0, offset=i),
        )  # fmt: skip
    assert state.status is Status.SUCCEEDED and state.prompt_version == f"v{HISTORY_LIMIT + 4}"
    assert len(state.history) == HISTORY_LIMIT
    assert state.history[-1].result_key == f"rk1-{HISTORY_LIMIT + 4}"
    assert TaskState.loads(state.dumps()) == state
    # A dead letter's move has no result key; it round-trips too.
    failed = state.moved(Status.DEAD_LETTERED, result_key=None, last_error={"category": "timeout"})
    assert TaskState.loads(failed.dumps()) == failed


async def test_identical_inputs_share_one_call() -> None:
    cache = ContentCache()
    calls = 0
    release = asyncio.Event()

    async def call() -> tuple[Any, tuple[dict[str, Any], str] | None]:
        nonlocal calls
        calls += 1
        await release.wait()
        return "outcome", ({"sentiment": "positive"}, "m")

    tasks = [asyncio.create_task(cache.shared("ck1-a", call)) for _ in range(5)]
    await asyncio.sleep(0.01)
    release.set()
    results = await asyncio.gather(*tasks)
    assert calls == 1
    assert results.count(("outcome", False)) == 1  # the caller that made the call
    assert results.count((({"sentiment": "positive"}, "m"), True)) == 4
    # Later identical inputs hit the cache without a call.
    assert await cache.shared("ck1-a", call) == (({"sentiment": "positive"}, "m"), True)
    assert calls == 1


async def test_a_failed_call_lets_waiters_call_themselves() -> None:
    cache = ContentCache()
    calls = 0

    async def dead() -> tuple[Any, tuple[dict[str, Any], str] | None]:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.01)
        return "dead letter", None

    first, second = await asyncio.gather(cache.shared("ck1-b", dead), cache.shared("ck1-b", dead))
    assert first == second == ("dead letter", False)
    assert calls == 2


def test_cache_is_bounded() -> None:
    cache = ContentCache(max_entries=3)
    for i in range(5):
        cache.put(f"k{i}", {"i": i}, "m")
    assert cache.get("k0") is None and cache.get("k1") is None
    assert cache.get("k4") == ({"i": 4}, "m")


def test_rocksdb_maps_start_empty_on_every_assignment(tmp_path: Any) -> None:
    from streams.kafka.store import Kind, close_maps, open_maps, rocks_dir
    from streams.settings import load_settings

    assert rocks_dir(load_settings()) is None  # memory:// by default
    settings = load_settings(store="rocksdb://", data_dir=tmp_path)
    base = rocks_dir(settings)
    assert base == tmp_path / "store"
    maps = open_maps(base, 3)
    maps[Kind.RESULTS][b"rk1-a"] = b"{}"
    assert maps[Kind.RESULTS].get(b"rk1-a") == b"{}" and b"rk1-a" in maps[Kind.RESULTS]
    del maps[Kind.RESULTS][b"rk1-a"]
    assert maps[Kind.RESULTS].get(b"rk1-a") is None
    maps[Kind.TASKS][b"t1"] = b"state"
    close_maps(maps)
    assert (tmp_path / "store" / "p3-tasks").exists()
    # The topics are the truth: a new assignment reads them into empty maps.
    again = open_maps(base, 3)
    assert again[Kind.TASKS].get(b"t1") is None
    close_maps(again)
    assert load_settings(store="rocksdb:///srv/x").store == "rocksdb:///srv/x"
    assert rocks_dir(load_settings(store="rocksdb:///srv/x")) == Path("/srv/x")


async def test_a_failed_load_is_tried_again_and_records_wait_until_it_succeeds(
    monkeypatch: Any,
) -> None:
    from streams.kafka import store as state_module
    from streams.kafka.store import Kind, TaskStore
    from streams.settings import load_settings

    attempts: list[int] = []

    async def flaky_load(settings: Any, topics: Any, partition: int, maps: Any, *_: Any) -> Any:
        attempts.append(partition)
        if len(attempts) < 3:
            raise OSError("broker away")
        maps[Kind.RESULTS][b"rk1-x"] = b"{}"
        return dict.fromkeys(Kind, 1)

    real_sleep = asyncio.sleep

    async def no_wait(_: float) -> None:
        await real_sleep(0)

    monkeypatch.setattr(state_module, "load_partition", flaky_load)
    monkeypatch.setattr(state_module.asyncio, "sleep", no_wait)

    async def send(*args: Any) -> None:
        return None

    store = TaskStore(load_settings(), send)
    store.assign({2})
    await asyncio.wait_for(store.ready(2), 5)  # waits through two failures
    assert attempts == [2, 2, 2]
    assert store.get(Kind.RESULTS, 2, b"rk1-x") == b"{}"
    await store.close()


def test_a_state_written_by_a_newer_version_is_read_with_its_extra_fields_ignored() -> None:
    """Rolling upgrade: a newer worker wrote fields this one does not know."""
    newer = orjson.dumps({
        "task_id": "t1", "status": "succeeded", "updated_at": "2026-01-01T00:00:00Z",
        "result_key": "rk1-x", "session": {"id": "s1"},
        "source": {"topic": "t", "partition": 0, "offset": 4, "leader_epoch": 3},
        "history": [{"status": "succeeded", "at": "x", "cost_usd": 0.1,
                     "source": {"topic": "t", "partition": 0, "offset": 4, "epoch": 1}}],
    })  # fmt: skip
    assert readable(Kind.TASKS, newer)
    state = TaskState.loads(newer)
    assert state.result_key == "rk1-x" and state.wrote(Source(topic="t", partition=0, offset=4))


@pytest.mark.parametrize(
    ("kind", "value", "ok"),
    [
        (Kind.TASKS, b"not json", False),
        (Kind.TASKS, b'{"task_id": "t1", "status": "a-newer-status", "updated_at": "x"}', False),
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


def test_a_record_wrote_its_outcome_when_its_move_is_in_the_history() -> None:
    """Two records of one task can each have written before their offsets committed;
    the check is per record, not only the latest writer."""
    a, b = Source(topic="t", partition=0, offset=1), Source(topic="t", partition=0, offset=2)
    state = TaskState(task_id="t1", status=Status.RECEIVED, updated_at="")
    state = state.moved(Status.SUCCEEDED, source=a).moved(Status.SUCCEEDED, source=b)
    assert state.wrote(a) and state.wrote(b)
    assert not state.wrote(Source(topic="t", partition=0, offset=3))
    assert not state.moved(Status.PROCESSING, source=Source(topic="t", partition=0, offset=3)
                           ).wrote(Source(topic="t", partition=0, offset=3))  # fmt: skip


def test_a_state_too_large_for_its_topic_drops_what_can_be_asked_again() -> None:
    state = TaskState(task_id="t1", status=Status.RECEIVED, updated_at="")
    for i in range(HISTORY_LIMIT):
        state = state.moved(Status.DEAD_LETTERED, source=Source(topic="t", partition=0, offset=i))
    state = state.model_copy(update={
        "stage_outputs": {"main": {"summary": "s" * 50_000}},
        "last_error": {"category": "timeout", "message": "m" * 20_000},
    })  # fmt: skip
    assert len(state.dumps()) > 70_000
    assert TaskState.loads(state.dumps_within(100_000)) == state  # fits: kept whole
    cut = TaskState.loads(state.dumps_within(10_000))
    assert cut.stage_outputs is None and cut.task_id == "t1" and len(cut.history) <= 1
    assert len(state.dumps_within(10_000)) <= 10_000
