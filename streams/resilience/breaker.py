"""Sliding-window circuit breaker per endpoint.

Closed -> open when, over the last `window_s`, at least `min_calls` calls ended
and the share of them that failed with an endpoint fault (timeout,
upstream_error) reaches `failure_rate`. While open no call is made; after
`open_s` it lets `probes` calls through (half-open): all succeed -> closed,
any fails -> open again. Rate limiting (429) is not an endpoint fault: the
limiter handles it. Every transition is logged and reported to `on_change`.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from enum import StrEnum

from streams.resilience.clock import Clock, MonotonicClock

log = logging.getLogger(__name__)


class State(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


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
        self._probes_sent = 0
        self._probes_ok = 0

    def _move(self, new: State) -> None:
        old, self.state = self.state, new
        self.transitions += 1
        log.warning("circuit %s: %s -> %s", self.name, old.value, new.value)
        if self.on_change is not None:
            self.on_change(self.name, old, new)

    def retry_at(self) -> float:
        """When a call may next be tried (now, unless open)."""
        if self.state is State.OPEN:
            return self.opened_at + self.open_s
        return self.clock.now()

    def allow(self) -> bool:
        """May a call go now? Counts a half-open probe when it says yes."""
        now = self.clock.now()
        if self.state is State.OPEN and now >= self.opened_at + self.open_s:
            self._probes_sent = self._probes_ok = 0
            self._move(State.HALF_OPEN)
        if self.state is State.CLOSED:
            return True
        if self.state is State.HALF_OPEN and self._probes_sent < self.probes:
            self._probes_sent += 1
            return True
        return False

    def release(self) -> None:
        """A call ended with no verdict on the endpoint (e.g. 429): free its probe slot."""
        if self.state is State.HALF_OPEN and self._probes_sent > self._probes_ok:
            self._probes_sent -= 1

    def record(self, ok: bool) -> None:
        now = self.clock.now()
        if self.state is State.HALF_OPEN:
            if not ok:
                self._open(now)
                return
            self._probes_ok += 1
            if self._probes_ok >= self.probes:
                self._calls.clear()
                self._failed = 0
                self._move(State.CLOSED)
            return
        if self.state is State.OPEN:
            return  # a straggler that started before the circuit opened
        calls = self._calls
        calls.append((now, ok))
        self._failed += not ok
        while calls and calls[0][0] < now - self.window_s:
            self._failed -= not calls.popleft()[1]
        if len(calls) >= self.min_calls and self._failed / len(calls) >= self.failure_rate:
            self._open(now)

    def _open(self, now: float) -> None:
        self.opened_at = now
        self._calls.clear()
        self._failed = 0
        self._move(State.OPEN)
