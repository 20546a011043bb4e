"""Workers' limiters against one key in virtual time (streams.dev.fleet): the worker's
own call path and retries, minutes of traffic in seconds, the same run every time."""

from __future__ import annotations

import pytest

from streams.dev.fleet import SHAPES, Shape, run_group, virtual_time


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


@pytest.mark.parametrize("name", ["minute", "second"])
async def test_a_group_learns_a_key_that_tells_its_limit(name: str) -> None:
    """Four workers on a 3,000-RPM key that says its limit (remaining against the minute,
    or against the enforcing second): the group takes nearly all of it."""
    shape = Shape(**{**SHAPES[name].__dict__, "rpm": 3000})
    used, refused, dead = await group(4, shape)
    assert used >= 0.97, used
    assert refused < 0.005 and dead == 0, (refused, dead)
