from __future__ import annotations

import asyncio
import contextlib

import pytest

from streams.contract.lanes import Lane
from streams.core.dispatch import Dispatcher, LaneSlots


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


async def test_jobs_cancelled_before_they_started_free_their_slots_and_keys() -> None:
    """Stopping cancels the jobs submitted but not yet started: they never ran a line,
    and their slots (shared with the other lane) and keys were kept."""
    slots = LaneSlots(4)
    d = Dispatcher(slots=slots)
    ran: list[str] = []

    async def job() -> None:
        ran.append("ran")

    for key in ("a", "b", "a"):
        await d.submit(key, job)
    assert slots.in_use[Lane.LIVE] == 3
    await d.cancel()  # before any job's first step
    assert ran == [] and slots.in_use[Lane.LIVE] == 0 and d._tails == {}
    assert d.in_flight == 0


def test_limit_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Dispatcher(0)


async def test_replay_never_takes_the_live_reserve_and_live_goes_first() -> None:
    slots = LaneSlots(4, reserve=1)
    for _ in range(3):
        await slots.acquire(Lane.REPLAY)
    # The fourth slot is live's: a replay job waits for it...
    replay = asyncio.create_task(slots.acquire(Lane.REPLAY))
    await asyncio.sleep(0)
    assert not replay.done()
    # ...and a live job takes it at once.
    await asyncio.wait_for(slots.acquire(Lane.LIVE), 1)
    assert slots.in_use == {Lane.LIVE: 1, Lane.REPLAY: 3}
    # Everything is taken: a live job waits too. A freed slot goes to live first.
    live = asyncio.create_task(slots.acquire(Lane.LIVE))
    await asyncio.sleep(0)
    slots.release(Lane.REPLAY)
    await asyncio.wait_for(live, 1)
    assert not replay.done() and slots.in_use == {Lane.LIVE: 2, Lane.REPLAY: 2}
    # With no live job waiting, replay gets freed slots (below its cap).
    slots.release(Lane.LIVE)
    await asyncio.wait_for(replay, 1)
    assert slots.in_use == {Lane.LIVE: 1, Lane.REPLAY: 3}


async def test_a_cancelled_wait_gives_no_slot_away() -> None:
    slots = LaneSlots(1)
    await slots.acquire(Lane.LIVE)
    waiting = asyncio.create_task(slots.acquire(Lane.REPLAY))
    await asyncio.sleep(0)
    waiting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiting
    slots.release(Lane.LIVE)
    assert slots.in_use == {Lane.LIVE: 0, Lane.REPLAY: 0}
    await asyncio.wait_for(slots.acquire(Lane.REPLAY), 1)


async def test_a_wait_cancelled_as_a_slot_frees_ends_cancelled_with_no_slot_taken() -> None:
    """Cancelled, a waiter's future is cancelled at once and its task resumes later: a
    slot freed in between passes it over and drops it from the queue. The wait then ends
    as cancelled (it raised ValueError from the queue, in place of the cancel), and the
    slot goes to the next waiter."""
    slots = LaneSlots(1)
    await slots.acquire(Lane.LIVE)
    cancelled = asyncio.create_task(slots.acquire(Lane.LIVE))
    after = asyncio.create_task(slots.acquire(Lane.LIVE))
    await asyncio.sleep(0)
    cancelled.cancel()
    slots.release(Lane.LIVE)  # before the cancelled wait's task runs again
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    await asyncio.wait_for(after, 1)
    assert slots.in_use == {Lane.LIVE: 1, Lane.REPLAY: 0}


async def test_lanes_with_their_own_dispatchers_share_the_slots() -> None:
    slots = LaneSlots(2, reserve=1)
    live, replay = (
        Dispatcher(slots=slots, lane=Lane.LIVE),
        Dispatcher(slots=slots, lane=Lane.REPLAY),
    )
    release = asyncio.Event()
    peak = {"replay": 0}

    async def job() -> None:
        peak["replay"] = max(peak["replay"], slots.in_use[Lane.REPLAY])
        await release.wait()

    await replay.submit("a", job)
    blocked = asyncio.create_task(replay.submit("b", job))  # replay's cap is 1
    await live.submit("c", job)  # live still gets a slot
    await asyncio.sleep(0)
    assert not blocked.done() and slots.in_use == {Lane.LIVE: 1, Lane.REPLAY: 1}
    release.set()
    await blocked
    await replay.drain()
    await live.drain()
    assert peak["replay"] == 1 and slots.in_use == {Lane.LIVE: 0, Lane.REPLAY: 0}


async def test_a_lane_is_idle_while_a_quarter_of_its_slots_are_free() -> None:
    slots = LaneSlots(8, reserve=2)  # a quarter: 2 slots
    assert slots.idle_for(Lane.LIVE) and slots.idle_for(Lane.REPLAY)
    for _ in range(5):
        await slots.acquire(Lane.REPLAY)
    assert slots.idle_for(Lane.LIVE)  # 3 of 8 free
    assert not slots.idle_for(Lane.REPLAY)  # replay may use 6: 1 left
    for _ in range(2):
        await slots.acquire(Lane.LIVE)
    assert not slots.idle_for(Lane.LIVE)  # 1 free: near the limit, batches gather
