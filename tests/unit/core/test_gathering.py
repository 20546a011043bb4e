"""Items gathered per key: handed on when full or when the first has waited long enough,
each key on its own."""

from __future__ import annotations

import asyncio

from streams.core.gathering import Gathering


async def test_a_key_is_handed_on_once_full_and_the_others_keep_gathering() -> None:
    ready: list[tuple[str, list[int]]] = []
    gathering: Gathering[str, int] = Gathering(lambda key, items: ready.append((key, items)))

    def full(items: list[int]) -> bool:
        return len(items) >= 3

    for n in range(3):
        gathering.add("a", n, full, linger_s=60)
    gathering.add("b", 9, full, linger_s=60)
    assert ready == [("a", [0, 1, 2])]
    gathering.close()  # b's timer with it


async def test_the_first_item_waits_at_most_its_linger() -> None:
    ready: list[tuple[str, list[int]]] = []
    gathering: Gathering[str, int] = Gathering(lambda key, items: ready.append((key, items)))
    gathering.add("a", 1, lambda items: False, linger_s=0.05)
    gathering.add("a", 2, lambda items: False, linger_s=10)  # the first's timer holds
    await asyncio.sleep(0.2)
    assert ready == [("a", [1, 2])]
    gathering.add("a", 3, lambda items: False, linger_s=0.05)  # a new round, a new timer
    await asyncio.sleep(0.2)
    assert ready == [("a", [1, 2]), ("a", [3])]


async def test_close_stops_every_timer_and_hands_nothing_on() -> None:
    ready: list[tuple[str, list[int]]] = []
    gathering: Gathering[str, int] = Gathering(lambda key, items: ready.append((key, items)))
    gathering.add("a", 1, lambda items: False, linger_s=0.05)
    gathering.close()
    await asyncio.sleep(0.2)
    gathering.flush("a")
    assert ready == []
