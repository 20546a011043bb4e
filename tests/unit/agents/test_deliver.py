"""Writing an outcome through the tables: a failed changelog write is written again, and a
worker that cannot write stops (the record stays unacked, so it runs again after the restart)."""

from __future__ import annotations

import asyncio
from typing import Any

import faust
import pytest
from aiokafka.errors import KafkaTimeoutError

from streams.agents import tasks as tasks_module
from streams.agents.tasks import SEND_ATTEMPTS, TaskAgent
from streams.processing.processor import Outcome
from streams.records import Source
from streams.settings import load_settings

OUTCOME = Outcome(kind="result", key="rk1-x", value=b"{}", task_id="t1")
SOURCE = Source(topic="t", partition=0, offset=1)


class FlakyTable:
    """Stands in for a DurableTable whose changelog writes fail `failures` times."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.puts: list[tuple[bytes, bytes]] = []

    def put(self, key: bytes, value: bytes) -> asyncio.Future[None]:
        self.puts.append((key, value))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if len(self.puts) <= self.failures:
            done.set_exception(KafkaTimeoutError("broker away"))
        else:
            done.set_result(None)
        return done


@pytest.fixture
def agent(monkeypatch: pytest.MonkeyPatch) -> TaskAgent:
    async def no_sleep(_: float) -> None:
        return None

    monkeypatch.setattr(tasks_module.asyncio, "sleep", no_sleep)
    app = faust.App("deliver-test", broker="kafka://127.0.0.1:1", autodiscover=False)
    return TaskAgent(app, load_settings(), make_processor=lambda: None)  # type: ignore[arg-type,return-value]


async def test_a_failed_write_is_written_again_until_the_broker_takes_it(agent: TaskAgent) -> None:
    table = FlakyTable(failures=3)
    agent.tables.results = table  # type: ignore[assignment]
    await agent._deliver(OUTCOME, None, SOURCE)
    assert table.puts == [(b"rk1-x", b"{}")] * 4


async def test_a_worker_that_cannot_write_crashes_instead_of_acking(
    agent: TaskAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    crashed: list[BaseException] = []

    async def crash(exc: BaseException) -> None:
        crashed.append(exc)

    monkeypatch.setattr(agent.app, "crash", crash)
    table = FlakyTable(failures=1000)
    agent.tables.dead_letters = table  # type: ignore[assignment]
    dead = Outcome(kind="dead_letter", key="t1", value=b"{}", task_id="t1")
    with pytest.raises(KafkaTimeoutError):
        await agent._deliver(dead, None, SOURCE)
    assert len(table.puts) == SEND_ATTEMPTS
    assert len(crashed) == 1


def test_the_tables_share_the_task_topics_partitions(agent: TaskAgent) -> None:
    tables: Any = agent.tables
    names = {t.name: t for t in agent.app.tables.values()}
    assert set(names) >= {"llm-streams-results", "llm-streams-dead-letters",
                          "llm-streams-task-state"}  # fmt: skip
    # The results and dead-letter topics ARE the changelogs: one write, nothing extra.
    assert tables.results.changelog_topic.get_topic_name() == agent.settings.topics.results
    assert (
        tables.dead_letters.changelog_topic.get_topic_name() == agent.settings.topics.dead_letters
    )
    assert all(t.partitions == agent.settings.kafka.partitions for t in names.values())
