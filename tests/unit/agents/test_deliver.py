"""Writing an outcome to Kafka: retried with backoff, and a worker that cannot write stops
(the record stays unacked, so it is processed again after the restart)."""

from __future__ import annotations

import asyncio
from typing import Any

import faust
import pytest
from aiokafka.errors import KafkaTimeoutError

from streams.agents import tasks as tasks_module
from streams.agents.tasks import SEND_ATTEMPTS, TaskAgent
from streams.processing.processor import Outcome
from streams.settings import load_settings

OUTCOME = Outcome(kind="result", key="rk1-x", value=b"{}", task_id="t1")


class FlakyTopic:
    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.sends = 0

    async def send(self, **kwargs: Any) -> asyncio.Future[None]:
        self.sends += 1
        if self.sends <= self.failures:
            raise KafkaTimeoutError("broker away")
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


@pytest.fixture
def agent(monkeypatch: pytest.MonkeyPatch) -> TaskAgent:
    async def no_sleep(_: float) -> None:
        return None

    monkeypatch.setattr(tasks_module.asyncio, "sleep", no_sleep)
    app = faust.App("deliver-test", broker="kafka://127.0.0.1:1", autodiscover=False)
    return TaskAgent(app, load_settings(), make_processor=lambda: None)  # type: ignore[arg-type,return-value]


async def test_a_failed_send_is_retried_until_the_broker_takes_it(agent: TaskAgent) -> None:
    topic = FlakyTopic(failures=3)
    agent.results_topic = topic  # type: ignore[assignment]
    await agent._deliver(OUTCOME)
    assert topic.sends == 4


async def test_a_worker_that_cannot_write_crashes_instead_of_acking(
    agent: TaskAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    crashed: list[BaseException] = []

    async def crash(exc: BaseException) -> None:
        crashed.append(exc)

    monkeypatch.setattr(agent.app, "crash", crash)
    topic = FlakyTopic(failures=1000)
    agent.dead_letter_topic = topic  # type: ignore[assignment]
    with pytest.raises(KafkaTimeoutError):
        await agent._deliver(Outcome(kind="dead_letter", key="t1", value=b"{}", task_id="t1"))
    assert topic.sends == SEND_ATTEMPTS
    assert len(crashed) == 1
