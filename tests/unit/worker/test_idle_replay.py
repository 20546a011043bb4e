"""The replay lane's partitions left out of the fetches while idle (`worker.idle_replay`),
on aiokafka's own subscription state: paused only once read to their end at two checks,
resumed as soon as their listed end passes their position, all fetched again when a
check fails. The live lane is never touched."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from aiokafka import TopicPartition
from aiokafka.consumer.subscription_state import SubscriptionState

from streams.worker import faust_private
from streams.worker.idle_replay import IdleReplay

REPLAY, LIVE = "llm-tasks-replay", "llm-tasks"
R0, R1, L0 = TopicPartition(REPLAY, 0), TopicPartition(REPLAY, 1), TopicPartition(LIVE, 0)


class Consumer:
    """aiokafka's consumer as this module uses it, over aiokafka's own subscription state;
    its listed ends are `ends` (or `fails`, raised)."""

    def __init__(self) -> None:
        self._subscription = SubscriptionState()
        self._subscription.assign_from_user({R0, R1, L0})
        self.ends: dict[TopicPartition, int] = {}
        self.fails: Exception | None = None
        self.listed: list[set[TopicPartition]] = []

    def at(self, tp: TopicPartition, position: int, highwater: int) -> None:
        """`tp` read to `position`, its last fetch having seen `highwater`."""
        self._subscription.seek(tp, position)
        state = self._subscription.subscription.assignment.state_value(tp)
        state.highwater, state.lso = highwater, highwater  # read_committed, no transaction

    def assignment(self) -> set[TopicPartition]:
        return self._subscription.assigned_partitions()

    def paused(self) -> set[TopicPartition]:
        return self._subscription.paused_partitions()

    def pause(self, *tps: TopicPartition) -> None:
        for tp in tps:
            self._subscription.pause(tp)

    def resume(self, *tps: TopicPartition) -> None:
        for tp in tps:
            self._subscription.resume(tp)

    async def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        self.listed.append(set(tps))
        if self.fails is not None:
            raise self.fails
        return {tp: self.ends[tp] for tp in tps}


class Gauge:
    value = -1.0

    def set(self, value: float) -> None:
        self.value = value


def _checker(gauge: Gauge | None = None) -> IdleReplay:
    return IdleReplay(lambda: None, REPLAY, 1.0, gauge)


async def test_a_replay_partition_read_to_its_end_at_two_checks_is_left_out() -> None:
    consumer, gauge = Consumer(), Gauge()
    idle = _checker(gauge)
    consumer.at(R0, 10, 10)  # read to its end
    consumer.at(R1, 4, 9)  # records left to read
    consumer.at(L0, 7, 7)  # live: always fetched
    await idle.check(consumer)
    assert consumer.paused() == set() and gauge.value == 0  # once is not enough
    await idle.check(consumer)
    assert consumer.paused() == {R0} and gauge.value == 1
    assert consumer.listed == []  # nothing was paused before: nothing listed


async def test_a_partition_that_moved_between_checks_is_not_left_out() -> None:
    consumer, idle = Consumer(), _checker()
    consumer.at(R0, 10, 10)
    await idle.check(consumer)
    consumer.at(R0, 12, 12)  # a record came and was read since: the lane is in use
    await idle.check(consumer)
    assert consumer.paused() == set()
    await idle.check(consumer)
    assert consumer.paused() == {R0}


async def test_a_paused_partition_is_fetched_again_once_its_end_passes_its_position() -> None:
    consumer, gauge = Consumer(), Gauge()
    idle = _checker(gauge)
    consumer.at(R0, 10, 10)
    consumer.at(R1, 3, 3)
    await idle.check(consumer)
    await idle.check(consumer)
    assert consumer.paused() == {R0, R1}
    consumer.ends = {R0: 10, R1: 4}  # a replay wrote to partition 1 (a short listed end too)
    await idle.check(consumer)
    assert consumer.listed == [{R0, R1}]
    assert consumer.paused() == {R0} and gauge.value == 1
    assert faust_private.fetch_position(consumer, R1) == 3  # read from where it stopped
    # No fetch has answered for it yet: its last one, before the pause, still says it is
    # at its end. It stays fetched until it has read up to the end listed.
    for _ in range(3):
        await idle.check(consumer)
        assert consumer.paused() == {R0}
    consumer.at(R1, 4, 4)
    await idle.check(consumer)
    await idle.check(consumer)
    assert consumer.paused() == {R0, R1}


async def test_a_failed_check_fetches_every_replay_partition_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    consumer, gauge = Consumer(), Gauge()
    consumer.at(R0, 10, 10)
    consumer.at(R1, 3, 3)
    # The test's consumer stands for the aiokafka one under Faust's.
    monkeypatch.setattr(faust_private, "kafka_consumer_on_loop", lambda given: given)
    running = asyncio.create_task(IdleReplay(lambda: consumer, REPLAY, 0.01, gauge).run())
    try:
        await _until(lambda: consumer.paused() == {R0, R1})
        assert gauge.value == 2
        consumer.fails = TimeoutError("ListOffsets unanswered")
        await _until(lambda: not consumer.paused())
        assert gauge.value == 0
        assert not running.done()  # it goes on checking
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(300):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not within 3 s")


async def test_a_partition_with_no_position_or_end_known_is_left_alone() -> None:
    consumer, idle = Consumer(), _checker()
    state = consumer._subscription.subscription.assignment.state_value(R0)
    assert not state.has_valid_position  # just assigned: no position yet
    await idle.check(consumer)
    await idle.check(consumer)
    assert consumer.paused() == set()
    consumer._subscription.seek(R0, 5)  # a position, but no fetch answered yet: no end
    await idle.check(consumer)
    await idle.check(consumer)
    assert consumer.paused() == set()
