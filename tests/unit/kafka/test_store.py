"""Task state records and the content cache (single flight + LRU)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from streams.kafka.store import Kind, readable


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
