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
