"""Task state records and the content cache (single flight + LRU)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from streams.kafka.store import Kind, readable


def test_where_the_store_lives() -> None:
    from streams.kafka.store import rocks_dir
    from streams.settings import load_settings

    settings = load_settings()
    assert rocks_dir(settings) == settings.data_dir / "store"  # on disk by default
    assert rocks_dir(load_settings(store="memory://")) is None
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
