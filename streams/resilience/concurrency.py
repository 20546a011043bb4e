"""How many calls an endpoint that sends no rate limits takes at once, learned.

A self-hosted server (llama.cpp, vLLM, Ollama, TGI) answers a few requests at a time
and queues the rest: it sends no `x-ratelimit-*` headers, so the rate limiter learns
nothing, and a worker firing its 64 tasks at 2 slots makes requests wait in the
server's queue past their read timeout — cancelled, their finished work thrown away,
retried, the breaker opened on a healthy server. Here the worker keeps its calls in
its own queue instead (live first), and lets through what the server works on at once.

The limit is found as TCP Vegas and Netflix's concurrency-limits find theirs, from the
queueing a call meets: a call's time beyond its service time. llama.cpp says its own
service time (`timings`: prompt and generation milliseconds), so its queueing is
measured, not guessed; for any other server the service time is estimated from the
round's pace against the long-run pace (seconds per unit of work, a generated token
being one unit and a prompt token `PROMPT_UNIT` of one), as Netflix's gradient limit
does: a round `TOLERANCE` times slower queued. Per round of `limit` calls: calls that
queued (more than the one a server does best to hold ready) take the limit down; none
did and the limit was in use, up by one (or doubled, until the first queue: slow start);
a timeout or an overload (503) cuts it to `DECREASE` of itself. It starts at the
server's own slots and one more when it says them (llama.cpp's `/props`), else at
`START`: one call alone shows the server's own pace, from which slow start doubles.

An endpoint that sends rate-limit headers (OpenAI, Azure, gateways) is limited by its
rate, not here: from its first such answer, the gate is open (`unlimited`).

The same service-time estimate bounds an attempt's read timeout (`timeout_for`):
never below the setting, and at least `TIMEOUT_FACTOR` times what the request should
take, so a long prompt on a slow CPU is not cut as if it hung — times the waves the
server needs for the calls in flight, since the calls the gate lets through beyond
the server's slots (one or two, by design) wait there for a slot first.

No library does this for asyncio with priority lanes (aiolimiter limits a rate;
netflix concurrency-limits is Java), hence this module.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from streams.contract.lanes import Lane
from streams.resilience.clock import Clock, MonotonicClock

log = logging.getLogger(__name__)

START = 1  # calls at once when the server does not say its slots (then slow start)
ALONE_WINDOW = 9  # the pace of one call at a time: the median of the last this-many
DECREASE = 0.7  # a timeout or an overload: the limit times this
QUEUED_SHARE = 0.25  # a call that waited longer than this share of its service queued
TOLERANCE = 1.5  # no server timings: a round this much slower than the long run queued
QUEUED_MIN_S = 0.05  # ... and at least this long (timer and network noise)
PROMPT_UNIT = 0.125  # a prompt token's work, in generated tokens
TIMEOUT_FACTOR = 4.0
RATE_WINDOW = 64  # the pace of the last this-many calls sets the read timeout


@dataclass(order=True)
class _Waiter:
    lane: int
    seq: int
    future: asyncio.Future[None] = field(compare=False)


@dataclass(frozen=True)
class Served:
    """What one call says of the server's capacity."""

    seconds: float  # from sent to answered
    prompt_tokens: int = 0
    completion_tokens: int = 0
    server_s: float | None = None  # the server's own time on it, when it says (llama.cpp)
    overloaded: bool = False  # a timeout, a 503: the server could not keep up


class ConcurrencyLimit:
    """Calls at once to one endpoint: a gate with lanes (live first), its limit learned."""

    def __init__(
        self,
        *,
        start: int | None = None,
        max_limit: int = 10_000,
        clock: Clock | None = None,
        name: str = "",
        on_change: Callable[[int | None], None] | None = None,
        learn: bool = True,
    ) -> None:
        self.max_limit = max(1, max_limit)
        self.limit = float(min(self.max_limit, start or 1))
        self.clock = clock or MonotonicClock()
        self.name = name
        self.unlimited = False  # the endpoint sends rate limits: its rate limits it
        self.learn = learn  # False: a fixed limit (benchmarks' sweeps)
        self.in_flight = 0
        self.slots: int | None = None  # what the server says it works on at once
        self.typical_s = 1.0  # a call's usual seconds, sent to answered (a moving mean)
        self.on_change = on_change  # told the whole limit (None: unlimited) when it moves
        self._queue: list[_Waiter] = []
        self._seq = itertools.count()
        self._rates: list[float] = []  # seconds per unit of the last RATE_WINDOW calls
        self._round: list[tuple[float, float, float | None]] = []  # seconds, units, server's
        self._busy_in_round = False  # the limit was all in use in this round
        self._baseline: float | None = None  # long-run seconds per unit (no server timings)
        self._alone: list[float] = []  # paces of rounds of one call at a time
        self._slower_before = False
        # Doubling each round until the first sign of a queue, as TCP's slow start: a
        # server that says nothing of itself gets its capacity found in a few rounds.
        self._slow_start = start is None

    @classmethod
    def open_gate(cls, name: str = "") -> ConcurrencyLimit:
        """A gate that limits nothing (and learns nothing)."""
        gate = cls(name=name)
        gate.unlimited = True
        return gate

    @property
    def current(self) -> int | None:
        """The limit in force (None: no limit here)."""
        return None if self.unlimited else max(1, int(self.limit))

    # -- the gate -------------------------------------------------------------------

    async def acquire(self, lane: Lane = Lane.LIVE) -> None:
        """Wait for a turn; every `acquire` that returns must be `release`d once."""
        if not self._queue and self._free():
            self._take()
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._queue, _Waiter(int(lane), next(self._seq), future))
        try:
            await future  # `_wake` counted the turn as ours when it set the result
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(None)  # granted, then cancelled: the turn passes on
            raise

    def _free(self) -> bool:
        return self.unlimited or self.in_flight < max(1, int(self.limit))

    def _take(self) -> None:
        self.in_flight += 1
        if self.in_flight >= max(1, int(self.limit)):
            self._busy_in_round = True

    def release(self, served: Served | None) -> None:
        """The call is over; `served`: what it showed (None: cancelled, no answer)."""
        self.in_flight = max(0, self.in_flight - 1)
        if served is not None:
            self.typical_s += (served.seconds - self.typical_s) * 0.1
        if served is not None and not self.unlimited and self.learn:
            self._learn(served)
        self._wake()

    def _wake(self) -> None:
        while self._queue and self._free():
            waiter = heapq.heappop(self._queue)
            if not waiter.future.done():
                self._take()
                waiter.future.set_result(None)

    def open(self) -> None:
        """The endpoint sends rate limits: no limit here from now on."""
        if not self.unlimited and self.learn:
            self.unlimited = True
            log.info("%s sends rate limits: its rate limits it, not a concurrency limit",
                     self.name)  # fmt: skip
            self._changed()
            self._wake()

    @property
    def waiting(self) -> int:
        return self.waiting_calls()

    def ready_in(self) -> float:
        """Seconds until a call would get a turn, behind the calls waiting: a turn's
        share of the calls' usual time (an estimate for the router; it takes nothing)."""
        if self._free() and not self._queue:
            return 0.0
        limit = max(1, int(self.limit))
        ahead = self.in_flight - limit + 1 + len(self._queue)
        return max(0.0, ahead / limit * self.typical_s)

    def waiting_calls(self) -> int:
        return sum(1 for w in self._queue if not w.future.done())

    def current_limit(self) -> int | None:
        return self.current

    # -- learning ---------------------------------------------------------------------

    def _learn(self, served: Served) -> None:
        if served.overloaded:
            self._slow_start = False
            self._set(max(1.0, self.limit * DECREASE), "a timeout or an overload")
            return
        units = served.completion_tokens + PROMPT_UNIT * served.prompt_tokens + 1.0
        self._round.append((served.seconds, units, served.server_s))
        work = served.seconds if served.server_s is None else min(served.seconds, served.server_s)
        self._rates.append(work / units)
        del self._rates[:-RATE_WINDOW]
        if len(self._round) < max(1, int(self.limit)):
            return
        fits = self._fits(self._round)
        if fits is not None:
            self._slow_start = False
            self._set(max(1.0, min(self.limit - 1, fits)), "calls queue at the server")
        elif self._busy_in_round:
            grown = self.limit * 2 if self._slow_start else self.limit + 1
            self._set(min(float(self.max_limit), grown), "")
        self._round, self._busy_in_round = [], False

    def _fits(self, calls: list[tuple[float, float, float | None]]) -> float | None:
        """How many calls at once the server took without queueing them in this round,
        or None when none queued. With its own timings (llama.cpp): a call queued when it
        spent more than `QUEUED_SHARE` of its service beyond it, and the server took the
        others. Without: the round's median pace against the long-run pace, `TOLERANCE`
        times slower (by `QUEUED_MIN_S` at least) two rounds running — a median, so that
        one slow call is no queue — and the limit in the proportion of the two."""
        timed = [(s, w) for s, _, w in calls if w is not None]
        if timed:
            queued = sum(1 for s, w in timed if s - w > max(QUEUED_MIN_S, QUEUED_SHARE * w))
            # One call waiting is the server's next, ready when a slot frees (the best
            # fixed limit of a real 2-slot server was 3): more than one is a queue.
            return len(calls) - queued + 1.0 if queued > 1 else None
        paces = sorted(s / u for s, u, _ in calls)
        pace = paces[len(paces) // 2]
        units = sorted(u for _, u, _ in calls)[len(calls) // 2]
        if int(self.limit) <= 1:  # one call at a time queues behind none of ours
            self._alone.append(pace)
            del self._alone[:-ALONE_WINDOW]
            self._baseline = sorted(self._alone)[len(self._alone) // 2]
            return None
        if self._baseline is None:
            self._baseline = pace
            return None
        slower = pace > TOLERANCE * self._baseline
        slower = slower and (pace - self._baseline) * units > QUEUED_MIN_S
        if not slower:  # the long-run pace follows; not while calls queue (it would take
            self._baseline += (pace - self._baseline) * 0.2  # the queue in and drift up)
        # Two slow rounds in a row: one is as likely a slow patch of the server's own.
        queued, self._slower_before = slower and self._slower_before, slower
        return self.limit * TOLERANCE * self._baseline / pace if queued else None

    def _set(self, limit: float, why: str) -> None:
        before = self.current
        self.limit = limit
        self._round, self._busy_in_round = [], False
        if self.current != before:
            if why:
                log.info("%s: %d calls at once (was %s): %s", self.name, self.current, before,
                         why)  # fmt: skip
            self._changed()
        self._wake()

    def tell_slots(self, slots: int | None) -> None:
        """The server says how many requests it works on at once: start there."""
        if not slots:
            return
        self.slots = slots  # the read timeout's waves count them, whatever the gate does
        if not self.unlimited and self.learn:
            self._slow_start = False  # its slots and one ready to take a freed slot
            self._set(float(min(self.max_limit, slots + 1)), f"the server has {slots} slots")
            self._changed()  # said, even when it is where the limit stood

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self.current)

    # -- timeouts -----------------------------------------------------------------------

    def timeout_for(self, configured: float, prompt_tokens: int, completion_budget: int) -> float:
        """A read timeout for a call this large, sent with `in_flight` calls out (itself
        among them): the setting, or `TIMEOUT_FACTOR` times what the server's typical
        pace says it should take once the calls ahead of it have had their slots,
        whichever is longer. The slots are what the server says, else the limit less the
        one call it holds ready."""
        if self.unlimited or not self._rates:
            return configured
        units = completion_budget + PROMPT_UNIT * prompt_tokens + 1.0
        typical = sorted(self._rates)[len(self._rates) // 2]  # the median rate, not the best
        slots = self.slots or max(1, int(self.limit) - 1)
        waves = -(-max(1, self.in_flight) // slots)  # services until this one is done
        return max(configured, TIMEOUT_FACTOR * typical * units * waves)


__all__ = ["ConcurrencyLimit", "Served"]
