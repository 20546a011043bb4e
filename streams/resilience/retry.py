"""Every retry of the project: a task's LLM call (`call_with_retries`), and the worker's
own I/O to Kafka (`retry_transient`: writes, loading the task store). Both over
tenacity; each names what it retries and is capped by attempts (or runs until the
caller is cancelled, for a load that records wait on), with waits that grow.

Retries of one task's LLM call: only what can succeed, capped by attempts and time.

Retried: rate_limited, timeout, upstream_error; invalid_output at most
`invalid_output_retries` times. An attempt that failed while the endpoint was
down (`endpoint_down`: its circuit open, or unreachable — an outage, not this
task's problem) does not count towards `max_attempts`; the task's deadline still
bounds it. Waits are exponential with full jitter, and a provider's Retry-After
wins when it is longer.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from tenacity import (
    AsyncRetrying,
    retry_if_exception,
)

from streams.errors import Category, RateLimited, StreamsError, Transient, UpstreamError

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 4
    backoff_base_s: float = 0.5
    backoff_max_s: float = 20.0
    invalid_output_retries: int = 1
    max_retry_after_s: float = 60.0

    def backoff(self, retry_number: int, rng: random.Random | None = None) -> float:
        """Full-jitter exponential backoff for the n-th retry (1-based)."""
        cap = min(self.backoff_max_s, self.backoff_base_s * 2 ** (retry_number - 1))
        return (rng or random).uniform(0, cap)

    def wait_after(
        self, number: int, exc: BaseException | None, rng: random.Random | None = None
    ) -> float:
        """The wait after the `number`-th attempt failed with `exc`: the backoff, or a
        provider's Retry-After (with a 429, or a 503's) when longer."""
        wait = self.backoff(number, rng)
        if isinstance(exc, RateLimited | UpstreamError) and exc.retry_after is not None:
            # Spread the herd: every caller throttled at once gets the same hint.
            hinted = min(exc.retry_after, self.max_retry_after_s)
            wait = max(wait, hinted * (rng or random).uniform(1.0, 1.5))
        return wait


@dataclass
class Attempts:
    """How many attempts a call made; read it after success or failure."""

    count: int = 0
    last_error: StreamsError | None = None
    #: attempts spent on earlier models (fallbacks count on from there)
    previous: int = 0


async def call_with_retries(
    fn: Callable[[Attempts], Awaitable[T]],
    policy: RetryPolicy,
    attempts: Attempts,
    *,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    rng: random.Random | None = None,
) -> T:
    """Call `fn` until it succeeds or the policy gives up; re-raise the last error."""
    invalid_seen = 0
    outage_attempts = 0

    def should_retry(exc: BaseException) -> bool:
        nonlocal invalid_seen
        if not isinstance(exc, Transient):
            return False
        if exc.category is Category.INVALID_OUTPUT:
            invalid_seen += 1
            return invalid_seen <= policy.invalid_output_retries
        return True

    def spent(number: int) -> bool:
        return number - outage_attempts >= policy.max_attempts

    async def attempt_number(number: int) -> T:
        nonlocal outage_attempts
        attempts.count = attempts.previous + number
        try:
            return await fn(attempts)
        except StreamsError as exc:
            attempts.last_error = exc
            if isinstance(exc, Transient) and (exc.endpoint_down or not exc.charged):
                outage_attempts += 1  # not charged to the task
            raise

    return await _plain_first(
        attempt_number,
        retry=should_retry,
        spent=spent,
        wait=lambda number, exc: policy.wait_after(number, exc, rng),
        sleep=sleep,
    )


async def retry_transient(
    fn: Callable[[], Awaitable[T]],
    *,
    what: str,
    transient: Callable[[BaseException], bool],
    attempts: int | None = None,
    within_s: float | None = None,
    first_s: float = 0.1,
    max_s: float = 5.0,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> T:
    """`fn()` again after each failure `transient` accepts, waiting `first_s` doubling up to
    `max_s`, at most `attempts` calls and no new call `within_s` seconds after the first
    (None: until the caller is cancelled); what is not transient, or the last failure,
    is raised as it is.

    Every write goes through here and nearly all succeed at once (`_plain_first`)."""
    started = time.monotonic()

    def spent(number: int) -> bool:
        if within_s is not None and time.monotonic() - started >= within_s:
            return True
        return attempts is not None and attempts > 0 and number >= attempts

    def wait(number: int, exc: BaseException | None) -> float:
        waited = min(first_s * 2.0 ** (number - 1), max_s)
        log.warning("%s failed (%r); retry %d in %.1fs", what, exc, number, waited)
        return waited

    return await _plain_first(lambda _: fn(), retry=transient, spent=spent, wait=wait,
                              sleep=sleep)  # fmt: skip


async def _plain_first(
    call: Callable[[int], Awaitable[T]],
    *,
    retry: Callable[[BaseException], bool],
    spent: Callable[[int], bool],
    wait: Callable[[int, BaseException | None], float],
    sleep: Callable[[float], Awaitable[None]],
) -> T:
    """`call(1)`, `call(2)`, ... while a failure is one to `retry` and the attempts are not
    `spent(number)`, waiting `wait(number, failure)` after the `number`-th. The first call
    is made plainly: nearly every call succeeds at once, and tenacity's machinery (its
    iterator, actions, a retry state) costs more than the call's own Python path; tenacity
    takes over from the second (its attempt numbers one behind)."""
    try:
        return await call(1)
    except Exception as exc:
        if not retry(exc) or spent(1):
            raise
        await sleep(wait(1, exc))
    retrying = AsyncRetrying(
        retry=retry_if_exception(retry),
        stop=lambda state: spent(state.attempt_number + 1),
        wait=lambda state: wait(
            state.attempt_number + 1, state.outcome.exception() if state.outcome else None
        ),
        sleep=sleep,
        reraise=True,
    )
    async for attempt in retrying:
        with attempt:
            return await call(attempt.retry_state.attempt_number + 1)
    raise AssertionError("unreachable: tenacity re-raises the last error")  # pragma: no cover
