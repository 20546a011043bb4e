from __future__ import annotations

from streams.resilience.breaker import Admission, CircuitBreaker, State
from streams.resilience.clock import FakeClock


def call(b: CircuitBreaker, ok: bool | None) -> None:
    """One call through the breaker (it must be let through) that ended with `ok`."""
    admission = b.admit()
    assert admission is not None
    b.settle(admission, ok)


def _breaker(clock: FakeClock, changes: list[tuple[State, State]]) -> CircuitBreaker:
    return CircuitBreaker(
        "sim", window_s=10, min_calls=4, failure_rate=0.5, open_s=5, probes=2, clock=clock,
        on_change=lambda _n, old, new: changes.append((old, new)),
    )  # fmt: skip


def test_opens_on_failure_rate_over_the_window_only_after_min_calls() -> None:
    clock = FakeClock()
    changes: list[tuple[State, State]] = []
    b = _breaker(clock, changes)
    for ok in (False, False, False):
        call(b, ok)
    assert b.state is State.CLOSED  # 3 calls < min_calls
    call(b, True)
    assert b.state is State.OPEN and changes == [(State.CLOSED, State.OPEN)]
    assert b.admit() is None
    assert b.retry_at() == clock.now() + 5


def test_old_failures_slide_out_of_the_window() -> None:
    clock = FakeClock()
    b = _breaker(clock, [])
    call(b, False)
    call(b, False)
    clock.advance(11)
    for _ in range(4):
        call(b, True)
    call(b, False)
    assert b.state is State.CLOSED  # 1 of 5 in the window failed


def test_half_open_probes_close_it_or_reopen_it() -> None:
    clock = FakeClock()
    changes: list[tuple[State, State]] = []
    b = _breaker(clock, changes)
    for _ in range(4):
        call(b, False)
    clock.advance(5)
    first, second = b.admit(), b.admit()
    assert first is not None and second is not None and b.admit() is None  # `probes` calls
    assert b.state is State.HALF_OPEN
    b.settle(first, True)
    b.settle(second, False)
    assert b.state is State.OPEN
    clock.advance(5)
    first, second = b.admit(), b.admit()
    assert first is not None and second is not None
    b.settle(first, True)
    b.settle(second, True)
    assert b.state is State.CLOSED
    assert [new for _, new in changes] == [
        State.OPEN,
        State.HALF_OPEN,
        State.OPEN,
        State.HALF_OPEN,
        State.CLOSED,
    ]
    assert b.transitions == 5


def test_the_running_failure_count_matches_the_window_at_every_call() -> None:
    """Calls arrive and expire at random; the breaker opens exactly when a recount
    of the window says it should (its count is kept incrementally, O(1) per call)."""
    import random

    rng = random.Random(3)
    clock = FakeClock()
    b = CircuitBreaker("sim", window_s=10, min_calls=20, failure_rate=0.3, open_s=1000,
                       clock=clock)  # fmt: skip
    window: list[tuple[float, bool]] = []
    opened = 0
    for _ in range(5000):
        clock.advance(rng.uniform(0, 0.2))
        ok = rng.random() > 0.25
        call(b, ok)
        window = [(t, g) for t, g in window if t >= clock.now() - 10] + [(clock.now(), ok)]
        failed = sum(1 for _, g in window if not g)
        should_open = len(window) >= 20 and failed / len(window) >= 0.3
        assert (b.state is State.OPEN) == should_open
        if should_open:  # start again from a closed breaker with an empty window
            opened += 1
            b = CircuitBreaker("sim", window_s=10, min_calls=20, failure_rate=0.3,
                               open_s=1000, clock=clock)  # fmt: skip
            window = []
    assert opened >= 3  # both outcomes were exercised


def _half_open(clock: FakeClock) -> tuple[CircuitBreaker, Admission, Admission]:
    b = _breaker(clock, [])
    for _ in range(4):
        call(b, False)
    clock.advance(5)
    first, second = b.admit(), b.admit()
    assert first is not None and second is not None and b.admit() is None
    return b, first, second


def test_a_probe_without_a_verdict_frees_its_slot_for_the_next_caller() -> None:
    """A probe cancelled (shutdown, deadline) or throttled says nothing about the
    endpoint: its slot goes to the next caller, so the breaker cannot stay half-open."""
    clock = FakeClock()
    b, first, second = _half_open(clock)
    b.settle(first, None)
    third = b.admit()
    assert third is not None and third.probe and b.admit() is None
    b.settle(second, True)
    b.settle(third, True)
    assert b.state is State.CLOSED


def test_a_probe_settles_once() -> None:
    clock = FakeClock()
    b, first, _second = _half_open(clock)
    b.settle(first, None)
    b.settle(first, None)  # a second settle of the same call frees nothing more
    assert b.admit() is not None and b.admit() is None
    assert b.probes_out() == 2


def test_a_late_probe_of_an_earlier_round_counts_for_nothing() -> None:
    clock = FakeClock()
    b, hung, failing = _half_open(clock)
    b.settle(failing, False)  # round 1 fails: open again
    clock.advance(5)
    again = b.admit()  # round 2
    assert again is not None and b.state is State.HALF_OPEN
    b.settle(hung, True)  # round 1's hung probe answers at last: not a round-2 success
    assert b.state is State.HALF_OPEN and b.probes_out() == 1
    b.settle(hung, False)
    assert b.state is State.HALF_OPEN
    other = b.admit()
    assert other is not None
    b.settle(again, True)
    b.settle(other, True)
    assert b.state is State.CLOSED


def test_a_call_admitted_while_closed_that_ends_after_the_circuit_opened_is_ignored() -> None:
    clock = FakeClock()
    b = _breaker(clock, [])
    straggler = b.admit()
    assert straggler is not None
    for _ in range(4):
        call(b, False)
    clock.advance(5)
    probe = b.admit()
    assert probe is not None and b.state is State.HALF_OPEN
    b.settle(straggler, True)  # not a probe: does not count towards closing
    assert b.state is State.HALF_OPEN and b.probes_out() == 1
