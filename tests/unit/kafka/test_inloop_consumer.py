"""The worker's Kafka consumer runs on the app's loop (streams.kafka.faust_private.InLoopConsumer); the
integration suite consumes through it (rebalances, fences, stops), these pin its shape."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TP

from streams.kafka import faust_private
from streams.kafka.app import create_app
from streams.settings import load_settings


def _app(**kafka: Any) -> Any:
    return create_app(load_settings(kafka={"broker_url": "kafka://127.0.0.1:1", **kafka}))


async def test_the_worker_consumes_on_its_own_loop_with_no_second_one() -> None:
    app = _app()
    delegate = app.consumer._thread
    assert isinstance(app.consumer, faust_private.InLoopConsumer)
    assert isinstance(delegate, faust_private._OnTheLoop)
    assert delegate.thread_loop is app.loop is delegate.loop  # no loop of its own

    def where(x: int) -> tuple[int, asyncio.AbstractEventLoop, int]:
        return threading.get_ident(), asyncio.get_running_loop(), x

    async def fails() -> None:
        raise ValueError("from the consumer")

    # What the thread version hands to its loop through a queue is awaited in place.
    ident, loop, x = await delegate.call_thread(_as_coro(where), 7)
    assert (ident, loop, x) == (threading.get_ident(), asyncio.get_running_loop(), 7)
    with pytest.raises(ValueError, match="from the consumer"):
        await delegate.call_thread(fails)


def _as_coro(fun: Any) -> Any:
    async def call(*args: Any) -> Any:
        return fun(*args)

    return call


async def test_rebalance_callbacks_reach_faust_directly(monkeypatch: pytest.MonkeyPatch) -> None:
    app = _app()
    seen: list[tuple[str, Any, int]] = []

    async def assigned(tps: set[TP], generation_id: int = 0) -> None:
        seen.append(("assigned", tps, threading.get_ident()))

    async def revoked(tps: set[TP]) -> None:
        seen.append(("revoked", tps, threading.get_ident()))

    monkeypatch.setattr(app.consumer, "on_partitions_assigned", assigned)
    monkeypatch.setattr(app.consumer, "on_partitions_revoked", revoked)
    tp = TP("llm-tasks", 0)
    await app.consumer._thread.on_partitions_revoked({tp})
    await app.consumer._thread.on_partitions_assigned({tp}, 3)
    me = threading.get_ident()
    assert seen == [("revoked", {tp}, me), ("assigned", {tp}, me)]


async def test_consumer_thread_setting_keeps_fausts_threaded_consumer() -> None:
    app = _app(consumer_thread=True)
    assert type(app.consumer) is faust_aiokafka.Consumer
    delegate = app.consumer._thread
    assert not isinstance(delegate, faust_private._OnTheLoop)
    assert delegate.thread_loop is not app.loop
