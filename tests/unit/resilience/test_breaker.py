from __future__ import annotations

from streams.resilience.breaker import CircuitBreaker, State
from streams.resilience.clock import FakeClock


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
        b.record(ok)
    assert b.state is State.CLOSED  # 3 calls < min_calls
    b.record(True)
    assert b.state is State.OPEN and changes == [(State.CLOSED, State.OPEN)]
    assert not b.allow()
    assert b.retry_at() == clock.now() + 5


def test_old_failures_slide_out_of_the_window() -> None:
    clock = FakeClock()
    b = _breaker(clock, [])
    b.record(False)
    b.record(False)
    clock.advance(11)
    for _ in range(4):
        b.record(True)
    b.record(False)
    assert b.state is State.CLOSED  # 1 of 5 in the window failed


def test_half_open_probes_close_it_or_reopen_it() -> None:
    clock = FakeClock()
    changes: list[tuple[State, State]] = []
    b = _breaker(clock, changes)
    for _ in range(4):
        b.record(False)
    clock.advance(5)
    assert b.allow() and b.allow() and not b.allow()  # exactly `probes` calls
    assert b.state is State.HALF_OPEN
    b.record(True)
    b.record(False)
    assert b.state is State.OPEN
    clock.advance(5)
    assert b.allow() and b.allow()
    b.record(True)
    b.record(True)
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
        b.record(ok)
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
