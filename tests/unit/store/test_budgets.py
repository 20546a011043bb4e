"""The spend under the caps saved through one producer kept between syncs, and a save that
fails offered again (never dropped)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from aiokafka.errors import KafkaConnectionError

from streams.contract.lanes import Lane
from streams.core.budget import Budgets
from streams.pipelines.specs import BudgetSpec, Caps
from streams.resilience.clock import FakeClock
from streams.settings import load_settings
from streams.store import budgets as kafka_budgets

START = 100 * 86400.0  # midnight UTC of a day


class Producer:
    """A producer that keeps what it was sent (or fails its sends while `failing`)."""

    made: list[Producer] = []

    def __init__(self, log: list[tuple[str, str, dict[str, Any]]], failing: list[bool]) -> None:
        self.log, self.failing = log, failing
        self.started = self.stopped = False
        Producer.made.append(self)

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True

    async def send(self, topic: str, value: bytes, key: bytes) -> asyncio.Future[None]:
        assert self.started and not self.stopped
        if self.failing[0]:
            raise KafkaConnectionError("broker away")
        self.log.append((topic, key.decode(), orjson.loads(value)))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


class Stored:
    """The worker's follower of the caps and spend topics, counting its reads."""

    def __init__(self, held: dict[str, dict[bytes, dict[str, Any]]] | None = None) -> None:
        self.held, self.reads = held or {}, 0

    async def latest(self, topic: str) -> dict[bytes, dict[str, Any]]:
        return (await self.latest_each(topic))[topic]

    async def latest_each(self, *topics: str) -> dict[str, dict[bytes, dict[str, Any]]]:
        self.reads += 1
        return {topic: dict(self.held.get(topic, {})) for topic in topics}


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> tuple[list[Any], list[bool]]:
    log: list[tuple[str, str, dict[str, Any]]] = []
    failing = [False]
    Producer.made = []
    monkeypatch.setattr(kafka_budgets.clients, "producer",
                        lambda settings, **options: Producer(log, failing))  # fmt: skip
    return log, failing


async def spend(budgets: Budgets, usd: float, partition: int = 0) -> None:
    spec = BudgetSpec(usd_per_day=100.0)
    (await budgets.hold("p", spec, Lane.LIVE, estimate=0.1, partition=partition)).settle(usd)


async def test_saves_go_through_one_producer_kept_until_the_worker_stops(
    sent: tuple[list[Any], list[bool]],
) -> None:
    log, _ = sent
    budgets = Budgets(FakeClock(START))
    sync = kafka_budgets.BudgetSync(load_settings(), budgets, Stored())  # type: ignore[arg-type]
    await sync.sync()
    assert Producer.made == []  # nothing spent: nothing made
    for usd in (0.25, 0.5):
        await spend(budgets, usd)
        await sync.sync()
    assert [value["spent_usd"] for _, _, value in log] == [0.25, 0.75]
    assert len(Producer.made) == 1 and not Producer.made[0].stopped  # one, kept
    await sync.stop()
    assert Producer.made[0].stopped
    await spend(budgets, 0.5)
    await sync.sync()  # stopped: nothing made again, the spend kept for no one
    assert len(Producer.made) == 1 and len(log) == 2


async def test_a_save_that_fails_is_offered_again_through_a_new_producer(
    sent: tuple[list[Any], list[bool]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    log, failing = sent
    budgets = Budgets(FakeClock(START))
    sync = kafka_budgets.BudgetSync(load_settings(), budgets, Stored())  # type: ignore[arg-type]
    await spend(budgets, 0.25, partition=0)
    await spend(budgets, 0.5, partition=1)
    failing[0] = True
    await sync.sync()
    assert log == [] and Producer.made[0].stopped  # failed: closed
    assert "could not sync the spend caps" in caplog.text
    failing[0] = False
    await spend(budgets, 0.25, partition=1)  # partition 0 spends no more: saved anyway
    await sync.sync()
    assert sorted((key, value["spent_usd"]) for _, key, value in log) == [
        ("p/all/day/0", 0.25), ("p/all/day/1", 0.75)]  # fmt: skip
    assert len(Producer.made) == 2 and not Producer.made[1].stopped
    await sync.stop()


async def test_marks_not_saved_are_offered_again() -> None:
    budgets = Budgets(FakeClock(START))
    await spend(budgets, 0.5, partition=3)
    marks = budgets.unsaved()
    assert budgets.unsaved() == []
    budgets.not_saved(marks)
    (again,) = budgets.unsaved()
    assert (again.key, again.spent_usd) == ("p/all/day/3", 0.5)


async def test_a_sync_reads_the_caps_and_the_spend_in_one_read() -> None:
    """Each read through the follower is a ListOffsets and a fetch at the end of every
    followed topic: the caps and the spend come from the same one."""
    settings = load_settings()
    day = int(START // 86400)
    follower = Stored({
        kafka_budgets.budgets_topic(settings): {b"p": {"budget": {"usd_per_day": 5.0}}},
        kafka_budgets.budget_spend_topic(settings): {b"p/all/day/2": {
            "pipeline": "p", "scope": "all", "window": "day", "partition": 2,
            "index": day, "spent_usd": 1.5}},
    })  # fmt: skip
    budgets = Budgets(FakeClock(START))
    await kafka_budgets.BudgetSync(settings, budgets, follower).sync()  # type: ignore[arg-type]
    assert follower.reads == 1
    assert budgets.overrides == {"p": BudgetSpec(usd_per_day=5.0)}
    await spend(budgets, 0.25, partition=2)  # opens the day's account, seeded from the mark
    assert budgets.spent("p", "all", "day") == pytest.approx(1.75)


async def test_a_spend_record_a_newer_version_wrote_is_read_and_a_bad_one_skipped() -> None:
    """A field a newer worker added to its saved spend is ignored, not a reason to drop
    the spend (during a rolling upgrade a partition's next owner would start its window
    from 0 and pass the cap); a record with a field of the wrong type is skipped."""
    settings = load_settings()
    day = int(START // 86400)
    mark = {"pipeline": "p", "scope": "all", "window": "day", "index": day, "spent_usd": 1.5}
    follower = Stored({
        kafka_budgets.budgets_topic(settings): {b"p": {"budget": {"usd_per_day": 5.0}}},
        kafka_budgets.budget_spend_topic(settings): {
            b"p/all/day/2": {**mark, "partition": 2, "tier": "flex", "currency": "USD"},
            b"p/all/day/3": {**mark, "partition": 3, "spent_usd": "lots"},
            b"p/all/day/4": {**mark, "partition": "four"},
            b"p/all/day/5": [1, 2, 3],
        },
    })  # fmt: skip
    budgets = Budgets(FakeClock(START))
    await kafka_budgets.BudgetSync(settings, budgets, follower).sync()  # type: ignore[arg-type]
    for partition in (2, 3):
        await spend(budgets, 0.25, partition=partition)
    assert budgets.spent("p", "all", "day") == pytest.approx(1.5 + 0.25 + 0.25)


async def test_caps_a_newer_version_stored_keep_what_this_one_knows() -> None:
    """Caps `llm-streams budget` of a newer version stored with a field this version does
    not know: the caps it knows hold (before, the record was skipped whole and the older
    workers spent without them); a record with a cap of the wrong type is still skipped."""
    settings = load_settings()
    follower = Stored({
        kafka_budgets.budgets_topic(settings): {
            b"p": {"budget": {"usd_per_day": 5.0, "usd_per_month": 90.0,
                              "live": {"usd_per_hour": 1.0, "burst_usd": 2.0}}},
            b"q": {"budget": {"usd_per_day": "a lot"}},
        },
        kafka_budgets.budget_spend_topic(settings): {},
    })  # fmt: skip
    budgets = Budgets(FakeClock(START))
    await kafka_budgets.BudgetSync(settings, budgets, follower).sync()  # type: ignore[arg-type]
    assert budgets.overrides == {"p": BudgetSpec(usd_per_day=5.0, live=Caps(usd_per_hour=1.0))}
