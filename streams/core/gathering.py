"""Items gathered per key until there are enough of them or the first has waited long
enough: the one rule behind prompt packs (`core.packing`) and batch files
(`core.batch`).

Hand-written: it is a dict of lists and a timer per key on the running loop;
`aiostream`/`asyncstdlib` chunk one stream by count or time, not many keys at once
with a test of fullness the caller owns (item count, bytes).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class Gathering(Generic[K, T]):
    """Items per key; `ready(key, items)` gets them once `full(items)` holds or
    `linger_s` after the first of them came."""

    def __init__(self, ready: Callable[[K, list[T]], None]) -> None:
        self._ready = ready
        self._items: dict[K, list[T]] = {}
        self._timers: dict[K, asyncio.TimerHandle] = {}

    def add(self, key: K, item: T, full: Callable[[list[T]], bool], linger_s: float) -> None:
        items = self._items.setdefault(key, [])
        items.append(item)
        if full(items):
            self.flush(key)
        elif key not in self._timers:
            self._timers[key] = asyncio.get_running_loop().call_later(linger_s, self.flush, key)

    def flush(self, key: K) -> None:
        """Hand on what `key` has gathered now."""
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        items = self._items.pop(key, [])
        if items:
            self._ready(key, items)

    def close(self) -> None:
        """Stop every timer; what was gathered is dropped (its waiters are told by their
        owner's own close)."""
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self._items.clear()


__all__ = ["Gathering"]
