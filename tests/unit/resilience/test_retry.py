from __future__ import annotations

import random

import pytest

from streams.errors import AuthError, BadRequest, InvalidOutput, RateLimited, Timeout, UpstreamError
from streams.resilience.retry import Attempts, RetryPolicy, call_with_retries, retry_transient


class FakeSleep:
    def __init__(self) -> None:
        self.waits: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)


def _failing(errors: list[Exception], result: str = "ok"):  # type: ignore[no-untyped-def]
    calls = []

    async def fn(attempts: Attempts) -> str:
        calls.append(attempts.count)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return result

    return fn, calls


async def test_transient_errors_are_retried_until_success() -> None:
    sleep = FakeSleep()
    fn, calls = _failing([UpstreamError("500"), Timeout("t")])
    attempts = Attempts()
    assert await call_with_retries(fn, RetryPolicy(max_attempts=4), attempts, sleep=sleep) == "ok"
    assert calls == [1, 2, 3] and attempts.count == 3
    assert len(sleep.waits) == 2


@pytest.mark.parametrize("error", [BadRequest("400"), AuthError("401")])
async def test_permanent_errors_are_not_retried(error: Exception) -> None:
    sleep = FakeSleep()
    fn, calls = _failing([error])
    attempts = Attempts()
    with pytest.raises(type(error)):
        await call_with_retries(fn, RetryPolicy(), attempts, sleep=sleep)
    assert calls == [1] and attempts.count == 1 and sleep.waits == []


async def test_gives_up_after_max_attempts_with_the_last_error() -> None:
    fn, calls = _failing([UpstreamError("a")] * 10)
    attempts = Attempts()
    with pytest.raises(UpstreamError):
        await call_with_retries(fn, RetryPolicy(max_attempts=3), attempts, sleep=FakeSleep())
    assert attempts.count == 3 and len(calls) == 3


def _down(message: str) -> UpstreamError:
    exc = UpstreamError(message)
    exc.endpoint_down = True
    return exc


async def test_attempts_failing_while_the_endpoint_is_down_are_not_charged() -> None:
    # Five failures during an outage (circuit open after each), then two of the task's
    # own: with max_attempts=3 it still gets its third attempt, which succeeds.
    fn, calls = _failing([_down(f"down {i}") for i in range(5)] + [UpstreamError("a")] * 2)
    attempts = Attempts()
    assert await call_with_retries(fn, RetryPolicy(max_attempts=3), attempts,
                                   sleep=FakeSleep()) == "ok"  # fmt: skip
    assert len(calls) == 8 and attempts.count == 8


async def test_own_failures_still_end_the_task_after_an_outage() -> None:
    fn, calls = _failing([_down("down"), UpstreamError("a"), UpstreamError("b"),
                          UpstreamError("c"), UpstreamError("d")])  # fmt: skip
    with pytest.raises(UpstreamError, match="c"):
        await call_with_retries(fn, RetryPolicy(max_attempts=3), Attempts(), sleep=FakeSleep())
    assert len(calls) == 4


async def test_invalid_output_is_retried_once() -> None:
    fn, _ = _failing([InvalidOutput("bad"), InvalidOutput("bad again")])
    attempts = Attempts()
    with pytest.raises(InvalidOutput):
        await call_with_retries(fn, RetryPolicy(max_attempts=5), attempts, sleep=FakeSleep())
    assert attempts.count == 2
    assert isinstance(attempts.last_error, InvalidOutput)


async def test_retry_after_wins_when_longer_than_backoff() -> None:
    sleep = FakeSleep()
    fn, _ = _failing([RateLimited("429", retry_after=7.0)])
    policy = RetryPolicy(backoff_base_s=0.01, backoff_max_s=0.01)
    await call_with_retries(fn, policy, Attempts(), sleep=sleep, rng=random.Random(1))
    assert 7.0 <= sleep.waits[0] <= 10.5


async def test_a_503s_retry_after_is_waited_out_too() -> None:
    """A model still loading, a server over capacity: a 503 says when to come back (RFC
    9110). It was retried at the backoff's pace, ~4 s for every attempt together, and
    the task dead-lettered while the server asked for 30."""
    from streams.llm.client import error_for_status

    error = error_for_status(503, None, "HTTP 503: overloaded", retry_after=30.0)
    assert isinstance(error, UpstreamError) and error.retry_after == 30.0
    sleep = FakeSleep()
    fn, _ = _failing([error])
    policy = RetryPolicy(backoff_base_s=0.01, backoff_max_s=0.01)
    await call_with_retries(fn, policy, Attempts(), sleep=sleep, rng=random.Random(1))
    assert 30.0 <= sleep.waits[0] <= 45.0


async def test_retry_after_is_capped() -> None:
    sleep = FakeSleep()
    fn, _ = _failing([RateLimited("429", retry_after=3600)])
    await call_with_retries(fn, RetryPolicy(max_retry_after_s=5), Attempts(), sleep=sleep)
    assert sleep.waits[0] <= 7.5


def test_backoff_is_full_jitter_exponential_and_capped() -> None:
    policy = RetryPolicy(backoff_base_s=1, backoff_max_s=8)
    rng = random.Random(3)
    for n, cap in [(1, 1), (2, 2), (3, 4), (4, 8), (10, 8)]:
        samples = [policy.backoff(n, rng) for _ in range(200)]
        assert min(samples) >= 0 and max(samples) <= cap
        assert max(samples) > cap * 0.8  # it spreads over the whole range


class _Flaky:
    """Fails with `errors` in turn, then answers."""

    def __init__(self, *errors: Exception) -> None:
        self.errors, self.calls, self.slept = list(errors), 0, []

    async def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


def _transient(exc: BaseException) -> bool:
    return isinstance(exc, ConnectionError)


@pytest.mark.parametrize("attempts", [None, 3, 8])
async def test_transient_failures_are_tried_again_with_doubling_waits(attempts: int | None) -> None:
    flaky = _Flaky(ConnectionError("a"), ConnectionError("b"))
    got = await retry_transient(flaky, what="w", transient=_transient, attempts=attempts,
                                first_s=0.1, max_s=5.0, sleep=flaky.sleep)  # fmt: skip
    assert got == "ok" and flaky.calls == 3
    assert flaky.slept == pytest.approx([0.1, 0.2])


async def test_the_last_failure_is_raised_after_the_attempts() -> None:
    flaky = _Flaky(*(ConnectionError(str(i)) for i in range(5)))
    with pytest.raises(ConnectionError, match="3"):
        await retry_transient(flaky, what="w", transient=_transient, attempts=4, first_s=1.0,
                              max_s=3.0, sleep=flaky.sleep)  # fmt: skip
    assert flaky.calls == 4
    assert flaky.slept == pytest.approx([1.0, 2.0, 3.0])  # capped at max_s


@pytest.mark.parametrize("attempts", [1, 5])
async def test_a_failure_not_transient_or_with_one_attempt_is_raised_at_once(attempts: int) -> None:
    error: Exception = ValueError("bad") if attempts == 5 else ConnectionError("down")
    flaky = _Flaky(error)
    with pytest.raises(type(error)):
        await retry_transient(flaky, what="w", transient=_transient, attempts=attempts,
                              sleep=flaky.sleep)  # fmt: skip
    assert flaky.calls == 1 and flaky.slept == []
