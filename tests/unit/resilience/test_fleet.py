"""Workers' limiters against one key in virtual time (streams.dev.fleet): the worker's
own call path and retries, minutes of traffic in seconds, the same run every time."""

from __future__ import annotations

import pytest

from streams.dev.fleet import SHAPES, Shape, run_group, virtual_time
from streams.resilience.clock import FakeClock
from streams.resilience.limiter import GroupShare, RateLimiter


async def group(workers: int, shape: Shape, minutes: float = 3.0) -> tuple[float, float, int]:
    with virtual_time():
        return await run_group(workers, shape, minutes, concurrency=32, seed=3)


async def test_a_limit_no_header_tells_is_measured_at_its_429s() -> None:
    """A provider that enforces 600 RPM and sends no x-ratelimit headers, only 429s with
    Retry-After: the limiter takes the pace it answered as the limit, instead of cutting
    from "unlimited" (which let nine calls in ten be refused)."""
    used, refused, dead = await group(1, Shape(headers=False, rpm=600))
    assert used >= 0.9, used
    assert refused < 0.05 and dead == 0, (refused, dead)


async def test_a_group_on_one_key_without_headers_keeps_to_the_limit() -> None:
    used, refused, dead = await group(4, Shape(headers=False, rpm=1200))
    assert used >= 0.85, used
    assert refused < 0.1 and dead == 0, (refused, dead)


@pytest.mark.parametrize("rpm", [3000, 1200])
@pytest.mark.parametrize("name", ["minute", "second"])
async def test_a_group_learns_a_key_that_tells_its_limit(name: str, rpm: int) -> None:
    """Four workers on a key that says its limit (remaining against the minute, or
    against the enforcing second): the group takes nearly all of it. At 1,200 RPM each
    worker's part is 5 calls a second: every worker waiting out each shortfall of the
    key's bucket as its own left 0.87-0.89 of the limit unused."""
    shape = Shape(**{**SHAPES[name].__dict__, "rpm": rpm})
    used, refused, dead = await group(4, shape)
    assert used >= 0.97, used
    assert refused < 0.005 and dead == 0, (refused, dead)


def test_the_parts_of_a_large_group_sum_to_the_key() -> None:
    """32 members of a group on a 3,000-RPM key: each claims its part, 1/32 of the key,
    not the limiter's floor of 5% (the group's claims would sum to 1.6 keys), and not
    more on a draw of the others' noisy estimate that reads them low."""
    clock = FakeClock()
    group = GroupShare()
    group.assigned(1, 32)
    limiter = RateLimiter(rpm=3000, clock=clock, group=group)
    bucket = limiter.requests
    bucket.sampled = True
    bucket.others_mean, bucket.others_var = 3000 * 31 / 32 / 60, 0.0
    assert limiter.share(bucket, 3000) == pytest.approx(3000 / 32)
    # The samples spread by 3 calls a second (their mean still right): what the mean
    # leaves, 94 RPM, is within the noise; no more than the part is claimed.
    bucket.others_mean -= 0.5
    bucket.others_var = 3.0**2
    assert limiter.share(bucket, 3000) == pytest.approx(3000 / 32)
    # The others are idle (their estimate well below the key, however noisy): the rest of
    # the key is ours, less the noise (half the spread, from a group this large).
    bucket.others_mean = 10.0
    margin = 0.5 * 3.0 * (1 - 2 / 32)
    assert limiter.share(bucket, 3000) == pytest.approx(3000 - (10.0 + margin) * 60)
    # Two members: no margin (the key's bucket catches a high draw of either).
    group.assigned(1, 2)
    assert limiter.share(bucket, 3000) == pytest.approx(3000 - 10.0 * 60)
