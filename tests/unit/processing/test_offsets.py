from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from streams.processing.offsets import Admission, InOrderAcks, StreamGuard


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


# -- StreamGuard: holes and duplicates ------------------------------------------------


def test_guard_passes_a_contiguous_stream() -> None:
    guard: StreamGuard[str] = StreamGuard()
    assert all(guard.admit("p", o, f"e{o}", committed=10) == Admission() for o in range(10, 20))


def test_guard_asks_to_seek_back_once_per_hole() -> None:
    guard: StreamGuard[str] = StreamGuard()
    assert guard.admit("p", 10, "a", committed=10) == Admission()
    assert guard.admit("p", 15, "b", committed=10) == Admission(seek_to=11)
    # After the seek the skipped records come, then 15 again: a duplicate.
    for o in range(11, 15):
        assert guard.admit("p", o, f"e{o}", committed=10) == Admission()
    assert guard.admit("p", 15, "b'", committed=10) == Admission(duplicate=True)
    # A real hole (a transaction marker) seen again is not sought twice.
    assert guard.admit("p", 18, "c", committed=10) == Admission(seek_to=16)
    assert guard.admit("p", 18, "c'", committed=10) == Admission(duplicate=True, gaps=((16, 17),))
    assert guard.admit("p", 19, "d", committed=10) == Admission()


def test_guard_sees_a_hole_at_the_committed_offset() -> None:
    guard: StreamGuard[str] = StreamGuard()
    assert guard.admit("p", 47, "a", committed=40) == Admission(seek_to=40)


def test_guard_acks_duplicates_after_their_original() -> None:
    guard: StreamGuard[str] = StreamGuard()
    guard.admit("p", 5, "orig", committed=5)
    assert guard.admit("p", 5, "dup1", committed=5) == Admission(duplicate=True)
    assert guard.acked("p", 5) == ["dup1"]
    # Once the original is acked, a later duplicate is acked at once.
    assert guard.admit("p", 5, "dup2", committed=5) == Admission(duplicate=True, ack_now=True)


def test_guard_follows_the_committed_offset_after_another_worker_moved_it() -> None:
    guard: StreamGuard[str] = StreamGuard()
    guard.admit("p", 10, "a", committed=10)
    guard.acked("p", 10)
    # The partition went away and came back at 50 (committed by another worker).
    assert guard.admit("p", 50, "b", committed=50) == Admission()
    guard.prune("p", committed=50)
    assert guard.admit("p", 10, "old", committed=50) == Admission()  # forgotten, not a dup


@given(
    st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=80),
)
def test_guard_processes_each_offset_once_and_acks_every_duplicate(deliveries: list[int]) -> None:
    """Whatever order and repeats the stream delivers, each offset is processed once and
    every duplicate is acked (now, or with its original)."""
    guard: StreamGuard[int] = StreamGuard()
    processed: list[int] = []
    acked_dups = 0
    dups = 0
    for i, offset in enumerate(deliveries):
        a = guard.admit("p", offset, i, committed=None)
        if a.duplicate:
            dups += 1
            acked_dups += a.ack_now
        else:
            processed.append(offset)
    for offset in set(processed):
        acked_dups += len(guard.acked("p", offset))
    assert sorted(processed) == sorted(set(deliveries))
    assert acked_dups == dups


def test_guard_confirms_what_the_seek_back_found_empty() -> None:
    guard: StreamGuard[str] = StreamGuard()
    guard.admit("p", 10, "a", committed=10)
    assert guard.admit("p", 16, "b", committed=10) == Admission(seek_to=11)
    # The seek back brings 12 and 14 only: 11, 13 and 15 are markers or compacted.
    assert guard.admit("p", 12, "c", committed=10) == Admission()
    assert guard.admit("p", 14, "d", committed=10) == Admission()
    assert guard.admit("p", 16, "b'", committed=10) == Admission(
        duplicate=True, gaps=((11, 11), (13, 13), (15, 15))
    )


def test_guard_seeks_again_over_a_hole_the_first_seek_did_not_fill() -> None:
    guard: StreamGuard[str] = StreamGuard()
    guard.admit("p", 10, "a", committed=10, now=0.0)
    assert guard.admit("p", 20, "b", committed=10, now=0.0) == Admission(seek_to=11)
    assert guard.unfilled(now=1.0, after_s=2.0) == []  # give the first seek its time
    guard.admit("p", 11, "c", committed=10, now=1.5)  # part of the hole came, then none
    assert guard.unfilled(now=2.5, after_s=2.0) == [("p", 12)]
    assert guard.unfilled(now=3.0, after_s=2.0) == []  # just sought again
    for o in range(12, 20):
        guard.admit("p", o, f"e{o}", committed=10, now=4.0)
    assert guard.unfilled(now=10.0, after_s=2.0) == []  # filled: nothing to seek
