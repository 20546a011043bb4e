"""Time as a dependency, so limiter and breaker tests run on a fake clock without sleeping."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...

    def call_later(self, seconds: float, callback: Callable[[], None]) -> Timer:
        """`callback` once `seconds` have passed, unless the timer is cancelled first:
        one loop timer, where a sleep that can be cut short takes a task of its own."""
        ...


class MonotonicClock:
    # The C function itself: asked about ten times a task (limiter, breaker, deadlines).
    now = staticmethod(time.monotonic)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def call_later(self, seconds: float, callback: Callable[[], None]) -> Timer:
        return asyncio.get_running_loop().call_later(seconds, callback)


class WallClock(MonotonicClock):
    """Seconds since the epoch: for windows of the calendar (clock hours, UTC days)."""

    now = staticmethod(time.time)


class FakeClock:
    """Time moves only when someone sleeps; sleepers wake in deadline order."""

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start
        self.slept: list[float] = []

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.t += max(0.0, seconds)
        await asyncio.sleep(0)

    def call_later(self, seconds: float, callback: Callable[[], None]) -> Timer:
        """Like `sleep`: at the loop's next turn the time moves and the callback runs."""
        self.slept.append(seconds)

        def fire() -> None:
            self.t += max(0.0, seconds)
            callback()

        return asyncio.get_running_loop().call_soon(fire)

    def advance(self, seconds: float) -> None:
        self.t += seconds
