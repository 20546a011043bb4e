from __future__ import annotations

import random

import pytest

from streams.errors import AuthError, BadRequest, InvalidOutput, RateLimited, Timeout, UpstreamError
from streams.resilience.retry import Attempts, RetryPolicy, call_with_retries


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
