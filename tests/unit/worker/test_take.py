"""The worker's take (`worker.take`) on a Faust stream of an in-memory channel: batches as
Faust's take makes them, no wake-up while nothing comes, events left for the caller
to ack."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import faust
import pytest

from streams.worker.take import take


@pytest.fixture
async def stream() -> AsyncIterator[Any]:
    # Never connected: a channel's stream needs the app's consumer object, not a broker.
    app = faust.App("take-test", broker="kafka://127.0.0.1:1", autodiscover=False,
                    loop=asyncio.get_running_loop())  # fmt: skip
    app.flow_control.resume()
    channel = app.channel()
    s = channel.stream()
    s.test_channel = channel
    yield s
    await s.stop()
    # The consumer object made its thread's event loop; never started, it is not closed.
    app.consumer._thread.thread_loop.close()


async def _batches(stream: Any, max_: int, within: float, sends: list[Any]) -> list[list[Any]]:
    """What `take` yields while `sends` go in: values, or a float to pause that long."""
    got: list[list[Any]] = []
    acks_while_taking: list[bool] = []

    async def consume() -> None:
        async for events in take(stream, max_, within):
            acks_while_taking.append(stream.enable_acks)
            got.append([e.value for e in events])

    task = asyncio.ensure_future(consume())
    await asyncio.sleep(0.05)  # subscribed
    for item in sends:
        if isinstance(item, float):
            await asyncio.sleep(item)
        else:
            await stream.test_channel.send(value=item)
    await asyncio.sleep(within * 4)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not any(acks_while_taking)  # Faust acks nothing: the caller does, when done
    assert stream.enable_acks  # and as it was once the take ends
    return got


async def test_a_full_batch_goes_at_once_the_rest_within_the_window(stream: Any) -> None:
    got = await _batches(stream, 3, 0.05, [0, 1, 2, 3, 4, 0.3, 9])
    assert got == [[0, 1, 2], [3, 4], [9]]


async def test_nothing_wakes_the_take_while_nothing_comes(stream: Any) -> None:
    """Faust's take sets a timer every `within` whether anything came or not (here ~50);
    this one sets none while nothing comes, then one for the batch's window, and makes
    no task per wait."""
    loop = asyncio.get_running_loop()
    call_later = loop.call_later
    timers: list[Any] = []

    def counted(delay: float, callback: Any, *args: Any, **kwargs: Any) -> Any:
        # asyncio.sleep's own timers are the test's pauses, not the take's.
        if callback is not asyncio.futures._set_result_unless_cancelled:  # type: ignore[attr-defined]
            timers.append(callback)
        return call_later(delay, callback, *args, **kwargs)

    create_task = loop.create_task
    tasks: list[str] = []

    def counted_task(coro: Any, **kwargs: Any) -> Any:
        tasks.append(getattr(coro, "__qualname__", repr(coro)))
        return create_task(coro, **kwargs)

    loop.call_later = counted  # type: ignore[method-assign]
    loop.create_task = counted_task  # type: ignore[method-assign]
    try:
        got = await _batches(stream, 100, 0.01, [0.5, 7, 0.3, 8])
    finally:
        del loop.call_later  # type: ignore[method-assign]
        del loop.create_task  # type: ignore[method-assign]
    assert got == [[7], [8]]
    assert len(timers) == 2  # the window of each batch
    # No task per wait (mode's wait_first made three per wait: the awaited, the stop, the
    # crash; here ~12): only the take's one wait for the stream's end (mode's own wait
    # for its stop or crash), made once for the take's life.
    assert sum("wait" in name for name in tasks) <= 3, tasks


async def test_the_streams_end_ends_the_take_at_once(stream: Any) -> None:
    """The stream's end (here a crash; a stop sets the same wait) wakes a take waiting
    for its first record: the loop ends."""
    ended = asyncio.Event()

    async def consume() -> None:
        async for _ in take(stream, 10, 0.05):
            pass
        ended.set()

    task = asyncio.ensure_future(consume())
    await asyncio.sleep(0.05)
    assert not task.done()
    await stream.crash(RuntimeError("the stream's end"))
    await asyncio.wait_for(ended.wait(), timeout=5)
    assert task.done() and task.exception() is None
    assert stream.enable_acks  # as it was before the take


async def test_with_room_for_them_records_go_at_once_not_after_the_window(stream: Any) -> None:
    """The window (here an hour) holds a batch for company only while nothing could start
    it anyway: with free slots, a lone record is handed out as it comes; without, it
    waits for its window as before."""
    got: list[list[Any]] = []
    room = [True]

    async def consume() -> None:
        async for events in take(stream, 10, 3600.0, eager=lambda: room[0]):
            got.append([e.value for e in events])

    task = asyncio.ensure_future(consume())
    await asyncio.sleep(0.05)
    await stream.test_channel.send(value="alone")
    await asyncio.wait_for(_until(lambda: got == [["alone"]]), 60)  # not in an hour
    room[0] = False
    await stream.test_channel.send(value="no room")
    await asyncio.sleep(0.2)
    assert got == [["alone"]]  # held for company: nothing could start it now
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def _until(check: Any) -> None:
    while not check():  # noqa: ASYNC110  # polled with a deadline, as the tests' rule says
        await asyncio.sleep(0.005)
