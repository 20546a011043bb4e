"""Bounded concurrency with per-key order: the in-flight half of offset safety.

At most `limit` jobs run at once (the caller blocks in `submit` beyond that, so
the consumer stops pulling records instead of buffering them). Jobs of one key
run one after another in submission order, so results of one task_id keep the
order of its events.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


class Dispatcher:
    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("limit must be >= 1")
        self.limit = limit
        self._slots = asyncio.Semaphore(limit)
        self._tails: dict[str, asyncio.Task[None]] = {}
        self._running: set[asyncio.Task[None]] = set()

    @property
    def in_flight(self) -> int:
        return len(self._running)

    async def submit(self, key: str, job: Callable[[], Awaitable[None]]) -> None:
        """Start `job` once a slot is free and earlier jobs of `key` are done."""
        await self._slots.acquire()
        previous = self._tails.get(key)
        task = asyncio.create_task(self._run(key, previous, job))
        self._tails[key] = task
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run(
        self, key: str, previous: asyncio.Task[None] | None, job: Callable[[], Awaitable[None]]
    ) -> None:
        try:
            if previous is not None and not previous.done():
                await asyncio.wait([previous])
            await job()
        except asyncio.CancelledError:
            raise
        except Exception:  # jobs handle their own errors; this only keeps the loop alive
            log.exception("dispatched job for key %r failed", key)
        finally:
            self._slots.release()
            if self._tails.get(key) is asyncio.current_task():
                del self._tails[key]

    async def drain(self) -> None:
        """Wait for every job submitted so far."""
        while self._running:
            await asyncio.wait(list(self._running))

    async def cancel(self) -> None:
        for task in list(self._running):
            task.cancel()
        if self._running:
            await asyncio.wait(list(self._running))
