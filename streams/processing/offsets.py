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

    def outstanding(self, partition: Hashable) -> int:
        return len(self._pending.get(partition, ()))


@dataclass(frozen=True)
class Admission:
    """What to do with a record the stream delivered."""

    duplicate: bool = False
    ack_now: bool = False  # a duplicate whose original is already acked
    seek_to: int | None = None  # the stream skipped offsets from here: seek back
    gaps: tuple[tuple[int, int], ...] = ()  # confirmed empty offset ranges (inclusive)


class StreamGuard(Generic[T]):
    """Watches the offsets a stream delivers, per partition, for two Faust failures.

    Holes: after a restart with tables, Faust 0.15.3 now and then never delivers
    a run of records (its fetcher races the seek to the committed offsets); its
    commit guard then stops that partition's commits for good. A hole is seen
    when a record arrives past the next expected offset (the committed offset,
    or the one after the last record taken); the caller seeks back to the hole's
    start, once per hole (transaction markers and compaction leave real holes,
    which then just come back as the record that revealed them).

    Faust would count such a jump as a gap (as for compaction) and commit past
    it, so the caller keeps Faust's own gap filling off for its input topics:
    offsets the seek back confirms empty come back in `Admission.gaps` for the
    caller to hand to Faust.

    Duplicates: records already taken (re-delivered by that seek or after a
    rebalance) are not processed again; each is acked after its original.
    """

    def __init__(self) -> None:
        self._next: dict[Hashable, int] = {}
        # offset -> duplicates waiting for the original's ack (None once acked)
        self._taken: dict[Hashable, dict[int, list[T] | None]] = {}
        self._sought: dict[Hashable, set[int]] = {}
        # offset that revealed a hole -> the hole's first offset
        self._holes: dict[Hashable, dict[int, int]] = {}
        # the same holes -> when they were last sought (see `unfilled`)
        self._sought_at: dict[Hashable, dict[int, float]] = {}

    def admit(
        self,
        partition: Hashable,
        offset: int,
        item: T,
        committed: int | None,
        now: float = 0.0,
    ) -> Admission:
        taken = self._taken.setdefault(partition, {})
        if offset in taken:
            gaps = self._confirmed_gaps(partition, offset, taken)
            waiting = taken[offset]
            if waiting is None:
                return Admission(duplicate=True, ack_now=True, gaps=gaps)
            waiting.append(item)
            return Admission(duplicate=True, gaps=gaps)
        expected = self._next.get(partition, committed)
        if expected is not None and committed is not None:
            expected = max(expected, committed)
        taken[offset] = []
        self._next[partition] = max(offset + 1, self._next.get(partition, 0))
        sought = self._sought.setdefault(partition, set())
        if expected is not None and offset > expected and expected not in sought:
            sought.add(expected)
            self._holes.setdefault(partition, {})[offset] = expected
            self._sought_at.setdefault(partition, {})[offset] = now
            return Admission(seek_to=expected)
        return Admission()

    def _confirmed_gaps(
        self, partition: Hashable, offset: int, taken: dict[int, list[T] | None]
    ) -> tuple[tuple[int, int], ...]:
        """The record that revealed a hole came again after the seek back: whatever in
        the hole did not come with it does not exist (markers, compaction)."""
        start = self._holes.get(partition, {}).pop(offset, None)
        self._sought_at.get(partition, {}).pop(offset, None)
        if start is None:
            return ()
        gaps: list[tuple[int, int]] = []
        for o in range(start, offset):
            if o in taken:
                continue
            if gaps and gaps[-1][1] == o - 1:
                gaps[-1] = (gaps[-1][0], o)
            else:
                gaps.append((o, o))
        return tuple(gaps)

    def unfilled(self, now: float, after_s: float) -> list[tuple[Hashable, int]]:
        """Holes sought more than `after_s` ago that are still open: (partition, first
        missing offset) to seek to again. Faust drops records below its read offset,
        so a seek can lose the race with a fetch still in flight; a later one wins."""
        again: list[tuple[Hashable, int]] = []
        for partition, holes in self._holes.items():
            taken = self._taken.get(partition, {})
            times = self._sought_at.setdefault(partition, {})
            for revealing, start in list(holes.items()):
                missing = next((o for o in range(start, revealing) if o not in taken), None)
                if missing is None:  # every record of it came: nothing left to confirm
                    del holes[revealing]
                    times.pop(revealing, None)
                elif now - times.get(revealing, now) >= after_s:
                    times[revealing] = now
                    again.append((partition, missing))
        return again

    def acked(self, partition: Hashable, offset: int) -> list[T]:
        """The original at `offset` was acked: its duplicates to ack now."""
        taken = self._taken.get(partition, {})
        waiting = taken.get(offset) or []
        taken[offset] = None
        return waiting

    def prune(self, partition: Hashable, committed: int) -> None:
        """Forget acked offsets below the committed one (they never come back)."""
        taken = self._taken.get(partition)
        if taken:
            for offset in [o for o, w in taken.items() if o < committed and w is None]:
                del taken[offset]
        sought = self._sought.get(partition)
        if sought:
            sought.difference_update({o for o in sought if o < committed})
        holes = self._holes.get(partition)
        if holes:
            for revealing in [r for r in holes if r < committed]:
                del holes[revealing]
                self._sought_at.get(partition, {}).pop(revealing, None)
