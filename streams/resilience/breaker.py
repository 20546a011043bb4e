"""Sliding-window circuit breaker per endpoint.

Closed -> open when, over the last `window_s`, at least `min_calls` calls ended
and the share of them that failed with an endpoint fault (timeout,
upstream_error) reaches `failure_rate`. While open no call is made; after
`open_s` it lets `probes` calls through (half-open): all succeed -> closed,
any fails -> open again. Rate limiting (429) is not an endpoint fault: the
limiter handles it. Every transition is logged and reported to `on_change`.

Every call the breaker lets through holds an `Admission`, and every admission
is settled exactly once, whatever ends the call (`GuardedClient` settles it in
a `finally`): with a verdict on the endpoint (ok / failed), or with none (a 429,
a call cancelled by shutdown, a rebalance or its task's deadline), which frees
a probe's slot for the next caller. A probe of an earlier half-open round that
settles late counts for nothing, so a hung probe can neither wedge the breaker
half-open nor close it by mistake.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from streams.resilience.clock import Clock, MonotonicClock

log = logging.getLogger(__name__)


STREAK = 3  # failed verdicts in a row after which a router cools a deployment off


class State(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(eq=False)
class Admission:
    """One call let through: a probe of half-open round `round`, or a closed-state call."""

    probe: bool
    round: int
    settled: bool = False


class CircuitBreaker:
    def __init__(
        self,
        name: str,
        *,
        window_s: float = 30.0,
        min_calls: int = 20,
        failure_rate: float = 0.5,
        open_s: float = 15.0,
        probes: int = 3,
        clock: Clock | None = None,
        on_change: Callable[[str, State, State], None] | None = None,
    ) -> None:
        self.name = name
        self.window_s = window_s
        self.min_calls = min_calls
        self.failure_rate = failure_rate
        self.open_s = open_s
        self.probes = probes
        self.clock = clock or MonotonicClock()
        self.on_change = on_change
        self.state = State.CLOSED
        self.opened_at = 0.0
        self.transitions = 0
        self._calls: deque[tuple[float, bool]] = deque()
        self._failed = 0  # failures in `_calls`, kept as calls come and go (O(1) per call)
        self._round = 0  # half-open rounds so far: tells a late probe from a current one
        self._probes_sent = 0
        self._probes_ok = 0
        self._changed: asyncio.Future[None] | None = None
        # Failed verdicts in a row, and when the last came: the window above judges late
        # when a healthy past fills it, so a router cools a deployment off meanwhile.
        self.streak = 0
        self._last_failed = 0.0

    def _move(self, new: State) -> None:
        old, self.state = self.state, new
        self.transitions += 1
        log.warning("circuit %s: %s -> %s", self.name, old.value, new.value)
        if self.on_change is not None:
            self.on_change(self.name, old, new)
        self._wake()

    def _wake(self) -> None:
        """Callers waiting for a probe slot look again."""
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)
        self._changed = None

    def changed(self) -> asyncio.Future[None]:
        """Resolves when the state moves or a probe slot frees (for callers that found
        every probe slot of a half-open round taken)."""
        if self._changed is None:
            self._changed = asyncio.get_running_loop().create_future()
        return self._changed

    def retry_at(self) -> float:
        """When a call may next be tried (now, unless open)."""
        if self.state is State.OPEN:
            return self.opened_at + self.open_s
        return self.clock.now()

    def blocked_for(self) -> float:
        """Seconds until `admit` would let a call through: 0 now; a half-open round with
        every probe slot taken, its open time (a guess: until its verdicts come)."""
        if self.state is State.OPEN:
            return max(0.0, self.opened_at + self.open_s - self.clock.now())
        if self.state is State.HALF_OPEN and self._probes_sent >= self.probes:
            return self.open_s
        return 0.0

    def _count_streak(self, ok: bool | None, now: float) -> None:
        if ok is not None:
            self.streak = 0 if ok else self.streak + 1
            if not ok:
                self._last_failed = now

    def cooling_for(self) -> float:
        """Seconds a router keeps calls away while the last `STREAK` or more verdicts all
        failed (the window may not have judged yet): 0.5 s, doubling with each failure
        more, at most `open_s`; then one call finds out. Calls it admits are not refused."""
        if self.streak < STREAK:
            return 0.0
        cool = min(self.open_s, 0.5 * 2.0 ** (self.streak - STREAK))
        return max(0.0, self._last_failed + cool - self.clock.now())

    def admit(self) -> Admission | None:
        """Let a call through (counting a half-open probe), or None: not now."""
        now = self.clock.now()
        if self.state is State.OPEN and now >= self.opened_at + self.open_s:
            self._round += 1
            self._probes_sent = self._probes_ok = 0
            self._move(State.HALF_OPEN)
        if self.state is State.CLOSED:
            return Admission(probe=False, round=self._round)
        if self.state is State.HALF_OPEN and self._probes_sent < self.probes:
            self._probes_sent += 1
            return Admission(probe=True, round=self._round)
        return None

    def settle(self, admission: Admission, ok: bool | None) -> None:
        """The admitted call ended: `ok` is its verdict on the endpoint, None for none
        (its probe slot goes to the next caller). A second settle does nothing."""
        if admission.settled:
            return
        admission.settled = True
        now = self.clock.now()
        self._count_streak(ok, now)
        if admission.probe:
            if self.state is not State.HALF_OPEN or admission.round != self._round:
                return  # a probe of a round that is over
            if ok is None:
                self._probes_sent -= 1
                self._wake()
            elif not ok:
                self._open(now)
            else:
                self._probes_ok += 1
                if self._probes_ok >= self.probes:
                    self._calls.clear()
                    self._failed = 0
                    self._move(State.CLOSED)
            return
        if ok is None or self.state is not State.CLOSED:
            return  # no verdict, or a straggler that started before the circuit opened
        calls = self._calls
        calls.append((now, ok))
        self._failed += not ok
        while calls and calls[0][0] < now - self.window_s:
            self._failed -= not calls.popleft()[1]
        if len(calls) >= self.min_calls and self._failed / len(calls) >= self.failure_rate:
            self._open(now)

    def probes_out(self) -> int:
        """Probe slots of the current half-open round that are taken."""
        return self._probes_sent - self._probes_ok if self.state is State.HALF_OPEN else 0

    def _open(self, now: float) -> None:
        self.opened_at = now
        self._calls.clear()
        self._failed = 0
        self._move(State.OPEN)
