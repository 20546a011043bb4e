from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from streams.core.offsets import InOrderAcks


def test_a_record_in_flight_holds_back_later_ones() -> None:
    acks: InOrderAcks[int] = InOrderAcks()
    t = [acks.started("p0", offset) for offset in (10, 11, 12)]
    assert acks.finished(t[1]) == []  # 10 still in flight: acking 11 would let 12 commit
    assert acks.finished(t[2]) == []
    assert acks.finished(t[0]) == [10, 11, 12]
    assert acks.outstanding("p0") == 0


def test_partitions_are_independent() -> None:
    acks: InOrderAcks[str] = InOrderAcks()
    a0 = acks.started(0, "a0")
    b0 = acks.started(1, "b0")
    assert acks.finished(b0) == ["b0"]
    assert acks.outstanding(0) == 1
    assert acks.finished(a0) == ["a0"]


@given(st.lists(st.tuples(st.integers(0, 3), st.integers()), min_size=1, max_size=60), st.randoms())
def test_released_items_are_always_a_prefix_of_each_partitions_arrivals(
    records: list[tuple[int, int]], rnd: object
) -> None:
    acks: InOrderAcks[tuple[int, int]] = InOrderAcks()
    tickets = [acks.started(p, (p, i)) for i, (p, _) in enumerate(records)]
    order = list(tickets)
    rnd.shuffle(order)  # type: ignore[attr-defined]
    released: dict[int, list[tuple[int, int]]] = {}
    finished: set[int] = set()
    for ticket in order:
        finished.add(id(ticket))
        for item in acks.finished(ticket):
            released.setdefault(item[0], []).append(item)
        for p, items in released.items():
            arrivals = [t for t in tickets if t.partition == p]
            assert items == [t.item for t in arrivals[: len(items)]]  # prefix, in order
            assert all(id(t) in finished for t in arrivals[: len(items)])  # only finished ones
    assert sum(len(v) for v in released.values()) == len(records)


def test_a_forgotten_partitions_tickets_are_never_released() -> None:
    """Given away (or dropped after a fence): its records run again from the committed
    offset, so no earlier run may ack them — not even one that finishes later, and not
    by releasing the records taken after it when the partition comes back."""
    acks: InOrderAcks[str] = InOrderAcks()
    old = [acks.started(0, f"old{i}") for i in range(3)]
    assert acks.finished(old[1]) == []
    assert acks.forget(0) == ["old0", "old1", "old2"]
    again = acks.started(0, "again0")  # the partition back, its records taken again
    assert acks.finished(old[0]) == [] and acks.finished(old[2]) == []
    assert acks.finished(again) == ["again0"]
    assert acks.forget(0) == [] and acks.partitions() == []
