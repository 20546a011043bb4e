"""Answers by content key, shared by identical inputs of any task in this worker."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any


class ContentCache:
    """Answers by content key, shared by identical inputs (any task id) in this worker.

    Bounded LRU of outputs, plus single flight: while one task's call for a
    content key runs, identical tasks wait for it instead of calling again.
    """

    def __init__(self, max_entries: int = 50_000) -> None:
        self.max_entries = max_entries
        self._done: OrderedDict[str, tuple[dict[str, Any], str]] = OrderedDict()
        self._running: dict[str, asyncio.Future[tuple[dict[str, Any], str] | None]] = {}

    def get(self, key: str) -> tuple[dict[str, Any], str] | None:
        hit = self._done.get(key)
        if hit is not None:
            self._done.move_to_end(key)
        return hit

    def put(self, key: str, output: dict[str, Any], model: str) -> None:
        self._done[key] = (output, model)
        self._done.move_to_end(key)
        while len(self._done) > self.max_entries:
            self._done.popitem(last=False)

    def forget(self, key: str) -> None:
        """An answer erased (its input was deleted upstream): not handed out again."""
        self._done.pop(key, None)

    async def shared(
        self, key: str, call: Callable[[], Awaitable[tuple[Any, tuple[dict[str, Any], str] | None]]]
    ) -> tuple[Any, bool]:
        """`call()` once per key at a time. Returns (what call returned, False) for the
        caller that made the call, or (the cached answer, True) for those that waited.
        When the call gives no answer (a dead letter), a waiter makes its own call."""
        while True:
            hit = self.get(key)
            if hit is not None:
                return hit, True
            running = self._running.get(key)
            if running is None:
                break
            waited = await asyncio.shield(running)
            if waited is not None:
                return waited, True
        future: asyncio.Future[tuple[dict[str, Any], str] | None] = (
            asyncio.get_running_loop().create_future()
        )
        self._running[key] = future
        answer: tuple[dict[str, Any], str] | None = None
        try:
            value, answer = await call()
            if answer is not None:
                self.put(key, *answer)
            return value, False
        finally:
            del self._running[key]
            future.set_result(answer)


__all__ = ["ContentCache"]
