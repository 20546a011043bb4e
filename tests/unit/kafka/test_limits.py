"""What each written topic takes, as the broker says — or Kafka's default, said plainly."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError

from streams.kafka import limits
from streams.kafka.limits import KAFKA_DEFAULT_MAX_MESSAGE_BYTES, read_limits
from streams.settings import load_settings


class _Admin:
    def __init__(self, *, start: Exception | None = None, describe: Any = None) -> None:
        self._start, self._describe, self.closed = start, describe, False

    async def start(self) -> None:
        if self._start is not None:
            raise self._start

    async def describe_configs(self, wanted: list[Any]) -> list[Any]:
        if isinstance(self._describe, Exception):
            raise self._describe
        return self._describe  # type: ignore[no-any-return]

    async def close(self) -> None:
        self.closed = True


class _Response:
    def __init__(self, resources: list[Any]) -> None:
        self.resources = resources


def _use(monkeypatch: pytest.MonkeyPatch, fake: _Admin) -> None:
    monkeypatch.setattr(limits, "admin", lambda settings: fake)


async def test_the_limits_the_broker_describes(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _Admin(describe=[_Response([
        (0, None, 2, "llm-results", [("max.message.bytes", "5000000", False, 5, False, [])]),
        (3, "unknown", 2, "llm-dead-letters", []),
    ])])  # fmt: skip
    _use(monkeypatch, fake)
    found = await read_limits(load_settings(), ["llm-results", "llm-dead-letters"])
    assert found.max_record("llm-results") == 1_048_576  # the producer's own bound
    assert found.topic_bytes == {"llm-results": 5_000_000}
    assert found.max_record("llm-dead-letters") == 1_048_576 and fake.closed


async def test_a_broker_that_does_not_serve_describe_configs_is_said_once_at_info(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Tansu closes the connection on DescribeConfigs: a fact of the broker, no alarm."""
    _use(monkeypatch, _Admin(describe=KafkaConnectionError("Connection at 127.0.0.1:9092 closed")))
    with caplog.at_level(logging.INFO, logger=limits.__name__):
        found = await read_limits(load_settings(), ["llm-results"])
    assert found.topic_bytes == {}
    assert [r.levelno for r in caplog.records if "describe" in r.getMessage()] == [logging.INFO]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_broker_that_cannot_be_asked_is_warned_about(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _use(monkeypatch, _Admin(start=KafkaConnectionError("Unable to bootstrap from 127.0.0.1:1")))
    with caplog.at_level(logging.INFO, logger=limits.__name__):
        found = await read_limits(load_settings(), ["llm-results"])
    assert found.max_record("llm-results") == min(1_048_576, KAFKA_DEFAULT_MAX_MESSAGE_BYTES)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "did not say what its topics take" in warned[0]
