"""Release records for acking in arrival order, per partition.

Faust commits the highest offset below which every acked offset is
contiguous, but it does not know about a record still in flight at the
committed position itself (or anywhere, before the first commit of a
partition): acking records 11..20 while 10 is in flight lets it commit 21.
So we never show Faust an ack out of order: a finished record is released
only when every record that arrived before it on its partition is finished.
The committed offset then never passes a record whose outcome is not written.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(eq=False)
class Ticket(Generic[T]):
    partition: Hashable
    item: T
    done: bool = field(default=False)


class InOrderAcks(Generic[T]):
    def __init__(self) -> None:
        self._pending: dict[Hashable, deque[Ticket[T]]] = {}

    def started(self, partition: Hashable, item: T) -> Ticket[T]:
        ticket = Ticket(partition, item)
        self._pending.setdefault(partition, deque()).append(ticket)
        return ticket

    def finished(self, ticket: Ticket[T]) -> list[T]:
        """Mark `ticket` done; return the items now safe to ack, oldest first."""
        ticket.done = True
        queue = self._pending.get(ticket.partition)
        released: list[T] = []
        while queue and queue[0].done:
            released.append(queue.popleft().item)
        if queue is not None and not queue:
            del self._pending[ticket.partition]
        return released

    def forget(self, partition: Hashable) -> list[T]:
        """Drop every ticket of `partition` (given away, or new to this worker again): none
        of them is released any more, whether finished or not — their records run again
        from the committed offset, by the partition's owner. Returns their items."""
        return [ticket.item for ticket in self._pending.pop(partition, ())]

    def partitions(self) -> list[Hashable]:
        return list(self._pending)

    def outstanding(self, partition: Hashable) -> int:
        return len(self._pending.get(partition, ()))

    def unfinished(self) -> dict[Hashable, int]:
        """Records taken and not yet released, per partition."""
        return {p: len(q) for p, q in list(self._pending.items()) if q}
