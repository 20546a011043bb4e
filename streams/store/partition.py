"""One task partition in the task store: its maps in the local copy and, per map, how
far they hold the changelog partition behind them (`Position`: the checkpoint never
passes a write in flight, nor one that failed)."""

from __future__ import annotations

import asyncio
from collections import Counter

from streams.store.maps import Kind, Maps


class Position:
    """How far the local maps hold one changelog partition: every record before `safe()`
    is in them. A write in flight may land below the highest offset written so far only
    if it started before that one was acked, so each write in flight holds the
    checkpoint at the top it saw when it began; a write that failed (it may be in the
    topic all the same) holds it until its key is written again."""

    def __init__(self, top: int) -> None:
        self.top = top  # past the highest record in the maps
        self._floors: dict[int, tuple[int, bytes]] = {}  # ticket -> (floor, key)
        self._uncertain: dict[bytes, int] = {}
        self._writing: Counter[bytes] = Counter()
        self._next = 0

    def begin(self, key: bytes) -> int:
        ticket, self._next = self._next, self._next + 1
        self._floors[ticket] = (self.top, key)
        self._writing[key] += 1
        return ticket

    def done(self, ticket: int, offset: int | None) -> None:
        _, key = self._end(ticket)
        self._uncertain.pop(key, None)  # a later write of the key supersedes a failed one
        if offset is not None:
            self.top = max(self.top, offset + 1)

    def failed(self, ticket: int) -> None:
        floor, key = self._end(ticket)
        self._uncertain.setdefault(key, floor)

    def writing(self, key: bytes) -> bool:
        """Is a write of `key` in flight?"""
        return key in self._writing

    def _end(self, ticket: int) -> tuple[int, bytes]:
        floor, key = self._floors.pop(ticket)
        self._writing[key] -= 1
        if self._writing[key] <= 0:
            del self._writing[key]
        return floor, key

    def safe(self) -> int:
        floors = [floor for floor, _ in self._floors.values()]
        return min([self.top, *floors, *self._uncertain.values()])


class StorePartition:
    """One task partition's maps in the local copy, how far each holds its changelog,
    and whether it is loaded (or given away)."""

    def __init__(self, maps: Maps) -> None:
        self.maps = maps
        self.positions = {kind: Position(0) for kind in Kind}
        self.ready = asyncio.Event()
        self.loading: asyncio.Task[None] | None = None
        self.gone = False  # released: its waiters are woken and told

    def checkpoint(self) -> dict[Kind, int]:
        return {kind: position.safe() for kind, position in self.positions.items()}


__all__ = ["Position", "StorePartition"]
