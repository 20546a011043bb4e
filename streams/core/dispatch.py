"""Bounded concurrency with per-key order: the in-flight half of offset safety.

At most `limit` jobs run at once (the caller blocks in `submit` beyond that, so
the consumer stops pulling records instead of buffering them). Jobs of one key
run one after another in submission order, so results of one task_id keep the
order of its events.

The live and replay lanes each have their own dispatcher (and their own Faust
stream, so a live record never queues behind replay records), sharing one
`LaneSlots`: live takes any free slot first; replay takes only what live
leaves, and never the last `reserve` slots, so a live record always finds one.
A job waiting on a batch of the provider's Batch API gives its slot back meanwhile
(`parked`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass

from streams.contract.lanes import Lane

log = logging.getLogger(__name__)


class LaneSlots:
    """`limit` slots shared by two lanes: live first; replay at most `limit - reserve`.

    `cap(n)` holds the slots to `n` for a while (the endpoint takes only so many calls at
    once: records then wait in Kafka, not as started tasks whose deadlines run out in a
    queue); the live reserve shrinks with it, in proportion."""

    def __init__(self, limit: int, reserve: int = 0) -> None:
        if limit < 1:
            raise ValueError("limit must be >= 1")
        if not 0 <= reserve < limit:
            raise ValueError("reserve must be >= 0 and below the limit")
        self.configured = limit
        self.configured_reserve = reserve
        self.limit = limit
        self.reserve = reserve
        self.in_use = {Lane.LIVE: 0, Lane.REPLAY: 0}
        self._waiters: dict[Lane, deque[asyncio.Future[None]]] = {
            Lane.LIVE: deque(), Lane.REPLAY: deque()
        }  # fmt: skip

    @classmethod
    def sharing(cls, limit: int, live_share: float) -> LaneSlots:
        """`limit` slots of which `live_share` (rounded, leaving replay one at least) is
        the live lane's alone."""
        return cls(limit, min(limit - 1, round(limit * live_share)))

    def idle_for(self, lane: Lane) -> bool:
        """Whether `lane` has a quarter of the slots free (none waiting): a worker far from
        busy, where a record's call should start at once; nearer the limit its records
        would wait for a slot anyway, and gather into batches meanwhile."""
        if self._waiters[Lane.LIVE] or self._waiters[lane]:
            return False
        free = self.limit - self.in_use[Lane.LIVE] - self.in_use[Lane.REPLAY]
        if lane is Lane.REPLAY:
            free = min(free, self.limit - self.reserve - self.in_use[Lane.REPLAY])
        return free >= max(1, self.limit // 4)

    def _free_for(self, lane: Lane) -> bool:
        if self.in_use[Lane.LIVE] + self.in_use[Lane.REPLAY] >= self.limit:
            return False
        return lane is Lane.LIVE or self.in_use[Lane.REPLAY] < self.limit - self.reserve

    async def acquire(self, lane: Lane) -> None:
        ahead = self._waiters[Lane.LIVE] or self._waiters[lane]
        if not ahead and self._free_for(lane):
            self.in_use[lane] += 1
            return
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[lane].append(granted)
        try:
            await granted  # `_wake` counted the slot as ours when it set the result
        except asyncio.CancelledError:
            waiting = self._waiters[lane]
            if granted.done() and not granted.cancelled():
                self.release(lane)  # granted as it was cancelled: the slot goes on
            elif granted in waiting:  # else a slot freed since passed it over, dropped
                waiting.remove(granted)
            raise

    def release(self, lane: Lane) -> None:
        self.in_use[lane] -= 1
        self._wake()

    def cap(self, n: int | None) -> None:
        """At most `n` slots from now on (None: the configured limit again). Slots in use
        beyond it are not taken back; no new one is given until under it."""
        limit = self.configured if n is None else max(1, min(self.configured, n))
        share = self.configured_reserve / self.configured
        reserve = min(self.configured_reserve, round(limit * share))
        if self.configured_reserve and limit > 1:
            reserve = max(1, reserve)
        self.limit, self.reserve = limit, min(reserve, limit - 1)
        self._wake()

    def _wake(self) -> None:
        for lane in (Lane.LIVE, Lane.REPLAY):
            waiting = self._waiters[lane]
            while waiting and self._free_for(lane):
                granted = waiting.popleft()
                if not granted.done():
                    self.in_use[lane] += 1
                    granted.set_result(None)
            if waiting:  # this lane still waits: nothing for the lanes after it
                return


@dataclass
class _Held:
    slots: LaneSlots
    lane: Lane
    held: bool = True


_HELD: ContextVar[_Held | None] = ContextVar("llm_streams_slot", default=None)


@contextlib.asynccontextmanager
async def parked() -> AsyncIterator[None]:
    """Give the running job's slot back while it waits on something slow that is not
    the LLM endpoint (a batch that takes hours); take one again before going on."""
    held = _HELD.get()
    if held is None or not held.held:
        yield
        return
    held.slots.release(held.lane)
    held.held = False
    try:
        yield
    finally:
        await held.slots.acquire(held.lane)  # cancelled here: not held, nothing to free
        held.held = True


class Dispatcher:
    def __init__(
        self, limit: int | None = None, *, slots: LaneSlots | None = None, lane: Lane = Lane.LIVE
    ) -> None:
        if slots is None:
            if limit is None or limit < 1:
                raise ValueError("limit must be >= 1")
            slots = LaneSlots(limit)
        self.limit = slots.limit
        self.lane = lane
        self._slots = slots
        self._tails: dict[str, asyncio.Task[None]] = {}
        self._running: set[asyncio.Task[None]] = set()

    @property
    def in_flight(self) -> int:
        return len(self._running)

    async def submit(self, key: str, job: Callable[[], Awaitable[None]]) -> None:
        """Start `job` once a slot is free and earlier jobs of `key` are done."""
        await self._slots.acquire(self.lane)
        previous = self._tails.get(key)
        held = _Held(self._slots, self.lane)
        task = asyncio.create_task(self._run(key, previous, job, held))
        self._tails[key] = task
        self._running.add(task)
        # Freed when the task ends, however: one cancelled before its first step never
        # runs a line of `_run`, and its slot and key were kept for the worker's life.
        task.add_done_callback(lambda done: self._ended(key, done, held))

    def _ended(self, key: str, task: asyncio.Task[None], held: _Held) -> None:
        self._running.discard(task)
        if held.held:
            held.held = False
            self._slots.release(self.lane)
        if self._tails.get(key) is task:
            del self._tails[key]

    async def _run(
        self,
        key: str,
        previous: asyncio.Task[None] | None,
        job: Callable[[], Awaitable[None]],
        held: _Held,
    ) -> None:
        _HELD.set(held)  # this task's own context: `parked()` inside the job finds it
        try:
            if previous is not None and not previous.done():
                await asyncio.wait([previous])
            await job()
        except asyncio.CancelledError:
            raise
        except Exception:  # jobs handle their own errors; this only keeps the loop alive
            log.exception("dispatched job for key %r failed", key)

    async def drain(self) -> None:
        """Wait for every job submitted so far."""
        while self._running:
            await asyncio.wait(list(self._running))

    async def cancel(self) -> None:
        for task in list(self._running):
            task.cancel()
        if self._running:
            await asyncio.wait(list(self._running))
