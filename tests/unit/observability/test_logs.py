"""Log lines: JSON or text, with the task in hand, never a secret or personal data."""

from __future__ import annotations

import asyncio
import logging

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from streams.observability.logs import (
    JsonLines,
    ScrubbedText,
    TaskContext,
    current_task_id,
    logging_config,
)

KEY = "sk-proj-LEAKCHECK-0123456789"


def record(message: str, *args: object, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError(f"payload had {KEY} and li.lei@example.com")
        except ValueError as e:
            exc_info = (type(e), e, e.__traceback__)
    r = logging.LogRecord("streams.test", logging.WARNING, __file__, 1, message, args, exc_info)
    TaskContext().filter(r)
    return r


async def test_json_lines_carry_the_task_and_hide_keys_and_pii() -> None:
    async def job() -> str:
        current_task_id.set("task-42")
        message = "call with %s failed for 13812345678 / %s"
        return JsonLines([KEY]).format(record(message, KEY, "4111 1111 1111 1111", exc=True))

    line = await asyncio.create_task(job())
    entry = orjson.loads(line)
    assert entry["task_id"] == "task-42" and entry["level"] == "warning"
    assert entry["message"] == "call with [SECRET] failed for [PHONE] / [BANK_CARD]"
    assert KEY not in line and "li.lei@example.com" not in line and "[EMAIL]" in entry["exc"]
    # Outside a job there is no task.
    assert orjson.loads(JsonLines([KEY]).format(record("idle")))["task_id"] is None


def test_text_lines_are_scrubbed_too() -> None:
    line = ScrubbedText([KEY]).format(record("key %s, mail a.b@c.io", KEY))
    assert KEY not in line and "a.b@c.io" not in line and "[SECRET]" in line


def test_a_password_in_a_url_is_scrubbed_whoever_logs_it() -> None:
    """The schema registry's URL with `user:pass@` appeared whole in retry warnings and
    start errors; any URL's password goes, the rest of the line stays readable."""
    line = ScrubbedText([]).format(record(
        "registry https://svc-user:s3cr3t-Pa55@registry.example:8081/subjects failed; "
        "kafka://broker:9092 fine"))  # fmt: skip
    assert "s3cr3t-Pa55" not in line
    assert "https://svc-user:[SECRET]@registry.example:8081/subjects" in line
    assert "kafka://broker:9092 fine" in line


def test_the_worker_hides_the_schema_registry_password_set_or_in_its_url() -> None:
    from streams.settings import load_settings
    from streams.worker.run import secrets

    settings = load_settings(schema_registry={"url": "https://u:pw-in-url-123@r:8081",
                                              "username": "u", "password": "pw-set-4567"})  # fmt: skip
    assert {"pw-in-url-123", "pw-set-4567"} <= set(secrets(settings))


async def test_a_readers_unsubscribe_leaves_no_line_other_consumer_lines_stay(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The worker's readers of its small topics let their partitions go after every read:
    a line of aiokafka's each time (every 15 s in an idle worker's log, saying nothing)."""
    config = logging_config("info", "text", [])
    readers = config["loggers"]["aiokafka.consumer.consumer"]["filters"]
    quiet = [config["filters"][name]["()"]() for name in readers]
    consumer = AIOKafkaConsumer(bootstrap_servers="127.0.0.1:1")
    with caplog.at_level(logging.INFO, logger="aiokafka.consumer.consumer"):
        consumer.assign([TopicPartition("llm-streams-budgets", 0)])
        consumer.unsubscribe()  # as kafka.scan.Follower does after each read
        logging.getLogger("aiokafka.consumer.consumer").info("Subscribed to topic(s): %s", "t")
    lines = [r for r in caplog.records if r.name == "aiokafka.consumer.consumer"]
    assert len(lines) == 2  # aiokafka's own line for the unsubscribe, and another
    kept = [r.getMessage() for r in lines if all(f.filter(r) for f in quiet)]
    assert kept == ["Subscribed to topic(s): t"]
    await consumer.stop()
