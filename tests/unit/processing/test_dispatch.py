from __future__ import annotations

import asyncio

import pytest

from streams.processing.dispatch import Dispatcher


async def test_concurrency_never_exceeds_the_limit() -> None:
    d = Dispatcher(3)
    running = peak = 0
    release = asyncio.Event()

    async def job() -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await release.wait()
        running -= 1

    async def feed() -> None:
        for i in range(10):
            await d.submit(f"k{i}", job)

    feeder = asyncio.create_task(feed())
    await asyncio.sleep(0.01)
    assert d.in_flight == 3 and not feeder.done()  # submit blocks: backpressure, no buffering
    release.set()
    await feeder
    await d.drain()
    assert peak == 3


async def test_jobs_of_one_key_run_in_order() -> None:
    d = Dispatcher(8)
    order: list[int] = []

    def job(i: int, delay: float):  # type: ignore[no-untyped-def]
        async def run() -> None:
            await asyncio.sleep(delay)
            order.append(i)

        return run

    await d.submit("same", job(1, 0.03))
    await d.submit("same", job(2, 0.0))
    await d.submit("same", job(3, 0.01))
    await d.drain()
    assert order == [1, 2, 3]


async def test_a_failing_job_frees_its_slot() -> None:
    d = Dispatcher(1)

    async def boom() -> None:
        raise RuntimeError("x")

    done = asyncio.Event()

    async def ok() -> None:
        done.set()

    await d.submit("a", boom)
    await d.submit("b", ok)
    await d.drain()
    assert done.is_set()


def test_limit_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Dispatcher(0)
