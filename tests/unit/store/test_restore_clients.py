"""A store partition's reader (its load, a standby's follower) that does not start is
stopped all the same: the follower retries while the broker is away and is cancelled at
every rebalance that moves its partition, and each start left behind held a client's
connections and tasks for the worker's life."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError

from streams.settings import load_settings
from streams.store import restore
from streams.store.maps import Kind


class Consumer:
    def __init__(self, refuse: bool) -> None:
        self.refuse = refuse
        self.calls: list[str] = []

    async def start(self) -> None:
        self.calls.append("start")
        if self.refuse:
            raise KafkaConnectionError("Unable to bootstrap from [('kafka', 9092)]")
        await asyncio.Event().wait()  # a broker that does not answer yet

    async def stop(self) -> None:
        self.calls.append("stop")


@pytest.mark.parametrize("read", [restore.load_partition, restore.follow_partition])
@pytest.mark.parametrize("refuse", [True, False])
async def test_a_store_reader_that_does_not_start_is_stopped(
    monkeypatch: pytest.MonkeyPatch, read: Any, refuse: bool
) -> None:
    made: list[Consumer] = []

    def reader(*_: Any, **__: Any) -> Consumer:
        made.append(Consumer(refuse))
        return made[-1]

    monkeypatch.setattr(restore, "reader", reader)
    reading = asyncio.create_task(read(load_settings(), {Kind.RESULTS: "r"}, 0, None))
    if refuse:
        with pytest.raises(KafkaConnectionError):
            await reading
    else:
        await asyncio.sleep(0.01)
        reading.cancel()  # the partition moved while its reader started
        with pytest.raises(asyncio.CancelledError):
            await reading
    assert made[0].calls == ["start", "stop"]
