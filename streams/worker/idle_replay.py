"""The replay lane's partitions out of the worker's fetches while they hold nothing new.

The worker's consumer fetches the live and the replay topics' partitions together, and a
fetch carries and answers every partition it asks for, empty or not: with the replay lane
idle (most of the time) half of each fetch's work in aiokafka — the request built, the
answer parsed, partition by partition — was for partitions with nothing to read. Counted
by bench/calls_per_task.py at 50 tasks/s: 4,160 Python calls a task with the replay
partitions fetched, 3,709 without, where aiokafka's share equals a bare pass-through's.

So a replay partition read to its end (its position at the end its last fetch saw) at two
checks in a row, with the same position, is paused in aiokafka (`AIOKafkaConsumer.pause`:
left out of fetch requests). At each check the paused partitions' ends are listed
(ListOffsets) and one with anything past its position is resumed. A replay's first record
is taken within `kafka.replay_idle_check_s` and a fetch; 0 turns this off.

Why no record is lost or stuck:
- Faust never pauses in aiokafka (its own pauses, for recovery and full stream buffers,
  filter what its `getmany` returns): aiokafka's paused partitions are this module's
  alone, read back at each check rather than kept. A rebalance's new assignment starts
  unpaused.
- An answer to a fetch made before the pause is dropped by aiokafka without moving the
  position: its records are fetched again on resume.
- A listed end can be short of the real one (Tansu lists the last batch's base + 1), but
  it is past the position whenever a record is: what was read before it was read in
  whole batches.
- A check that fails (the broker away, a timeout) resumes every paused partition: the
  lane is fetched as before until a check succeeds again.
- Only with the consumer on the worker's loop (the default): with `kafka.consumer_thread`
  aiokafka runs on another thread's loop, and the lane is always fetched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from streams.worker import faust_private

log = logging.getLogger(__name__)

LIST_TIMEOUT_S = 10.0  # a ListOffsets unanswered this long fails the check


class IdleReplay:
    """Pauses and resumes the replay topic's assigned partitions in the aiokafka consumer
    under the Faust consumer that `faust_consumer()` gives."""

    def __init__(
        self, faust_consumer: Callable[[], Any], topic: str, every_s: float, idle: Any = None
    ) -> None:
        self._faust_consumer = faust_consumer
        self._idle = idle  # a gauge of the partitions left out (Metrics.replay_idle)
        self.topic = topic
        self.every_s = every_s
        self._caught_up: dict[Any, int] = {}  # replay partitions at their end at the last check
        self._woken: dict[Any, int] = {}  # partitions resumed -> the end listed then

    async def run(self) -> None:
        """Check every `every_s` until cancelled; a failed check fetches the lane again."""
        while True:
            await asyncio.sleep(self.every_s)
            consumer = faust_private.kafka_consumer_on_loop(self._faust_consumer())
            if consumer is None:  # not started yet, or on a thread of its own
                continue
            try:
                await self.check(consumer)
            except Exception as exc:
                log.warning("replay lane: checking its partitions' ends failed (%r); "
                            "fetching them all until a check succeeds", exc)  # fmt: skip
                self._caught_up.clear()
                self._woken.clear()
                with contextlib.suppress(Exception):  # the consumer stopping: nothing to fetch
                    consumer.resume(*(self._lane(consumer) & consumer.paused()))
                if self._idle is not None:
                    self._idle.set(0)

    def _lane(self, consumer: Any) -> set[Any]:
        return {tp for tp in consumer.assignment() if tp.topic == self.topic}

    async def check(self, consumer: Any) -> None:
        """Resume the paused partitions with records past their position; pause the ones
        read to their end at this check and the last, at the same position."""
        paused = self._lane(consumer) & consumer.paused()
        if paused:
            async with asyncio.timeout(LIST_TIMEOUT_S):
                ends = await consumer.end_offsets(list(paused))
            # Read again after the wait: a rebalance may have moved them meanwhile.
            still = self._lane(consumer) & consumer.paused()
            wake = [tp for tp in paused & still if _has_more(consumer, tp, ends.get(tp))]
            if wake:
                log.debug("replay lane: records in %s: fetched again", wake)
                consumer.resume(*wake)
                # Until a fetch has read up to the end listed, the partition's last fetch
                # (before the pause) still says it is at its end.
                self._woken.update((tp, ends.get(tp) or 0) for tp in wake)
        lane = self._lane(consumer)
        self._woken = {tp: end for tp, end in self._woken.items() if tp in lane}
        caught_up: dict[Any, int] = {}
        for tp in lane - consumer.paused():
            at = faust_private.caught_up(consumer, tp)
            if at is None or at < self._woken.get(tp, 0):
                continue
            self._woken.pop(tp, None)
            if self._caught_up.get(tp) == at:
                log.debug("replay lane: %s read to its end (%d): left out of fetches", tp, at)
                consumer.pause(tp)
            else:
                caught_up[tp] = at
        self._caught_up = caught_up
        if self._idle is not None:
            self._idle.set(len(self._lane(consumer) & consumer.paused()))


def _has_more(consumer: Any, tp: Any, end: int | None) -> bool:
    """A paused partition has records past its position (or it cannot be told)."""
    position = faust_private.fetch_position(consumer, tp)
    return end is None or position is None or end > position


__all__ = ["IdleReplay"]
