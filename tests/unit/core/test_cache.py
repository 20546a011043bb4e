"""The content cache: single flight and a bounded LRU."""

from __future__ import annotations

import asyncio
from typing import Any

from streams.core.cache import ContentCache


async def test_identical_inputs_share_one_call() -> None:
    cache = ContentCache()
    calls = 0
    release = asyncio.Event()

    async def call() -> tuple[Any, tuple[dict[str, Any], str] | None]:
        nonlocal calls
        calls += 1
        await release.wait()
        return "outcome", ({"sentiment": "positive"}, "m")

    tasks = [asyncio.create_task(cache.shared("ck1-a", call)) for _ in range(5)]
    await asyncio.sleep(0.01)
    release.set()
    results = await asyncio.gather(*tasks)
    assert calls == 1
    assert results.count(("outcome", False)) == 1  # the caller that made the call
    assert results.count((({"sentiment": "positive"}, "m"), True)) == 4
    # Later identical inputs hit the cache without a call.
    assert await cache.shared("ck1-a", call) == (({"sentiment": "positive"}, "m"), True)
    assert calls == 1


async def test_tasks_that_waited_get_answers_of_their_own() -> None:
    cache = ContentCache()
    answer: dict[str, Any] = {"aspects": [{"name": "zip"}]}
    release = asyncio.Event()

    async def call() -> tuple[Any, tuple[dict[str, Any], str] | None]:
        await release.wait()
        return answer, (answer, "m")

    for size in (cache.max_bytes, 1):  # the answer kept, then too large to keep
        cache.max_bytes = size
        cache.forget("ck1-c")
        tasks = [asyncio.create_task(cache.shared("ck1-c", call)) for _ in range(3)]
        await asyncio.sleep(0.01)
        release.set()
        (_, shared_by_caller), *waiters = await asyncio.gather(*tasks)
        release.clear()
        outputs = [output for (output, _), shared in waiters]
        assert outputs == [answer, answer] and not shared_by_caller
        assert outputs[0] is not answer and outputs[1] is not answer
        assert outputs[0]["aspects"] is not outputs[1]["aspects"]


async def test_a_failed_call_lets_waiters_call_themselves() -> None:
    cache = ContentCache()
    calls = 0

    async def dead() -> tuple[Any, tuple[dict[str, Any], str] | None]:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.01)
        return "dead letter", None

    first, second = await asyncio.gather(cache.shared("ck1-b", dead), cache.shared("ck1-b", dead))
    assert first == second == ("dead letter", False)
    assert calls == 2


def test_cache_is_bounded() -> None:
    cache = ContentCache(max_entries=3)
    for i in range(5):
        cache.put(f"k{i}", {"i": i}, "m")
    assert cache.get("k0") is None and cache.get("k1") is None
    assert cache.get("k4") == ({"i": 4}, "m")


def test_cache_is_bounded_in_bytes_and_hands_out_copies() -> None:
    """Large answers push the oldest out before the entry count does; a hit is the
    answer as it was put, whatever an earlier reader did to its copy."""
    big = {"summary": "x" * 1000}
    cache = ContentCache(max_entries=100, max_bytes=3 * 1100)
    for i in range(5):
        cache.put(f"k{i}", {**big, "i": i}, "m")
    assert [cache.get(f"k{i}") is not None for i in range(5)] == [False, False, True, True, True]
    first = cache.get("k4")
    assert first == ({**big, "i": 4}, "m")
    first[0]["summary"] = "changed by a reader"
    assert cache.get("k4") == ({**big, "i": 4}, "m")
    cache.forget("k4")
    cache.put("k5", {"i": 5}, "m")  # room again: the others stay
    assert cache.get("k4") is None and cache.get("k2") is not None and cache.get("k5") is not None
