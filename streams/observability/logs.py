"""Worker logs: text or JSON lines, with the task in hand, scrubbed of secrets and PII.

Every line passes through a scrubber: the API keys the worker knows are
replaced by `[SECRET]`, and the redactor used on prompts runs over the message
(e-mails, phones, ID and card numbers), so an exception that quotes a payload
does not put personal data in the logs. In JSON mode each line is one object:
`ts`, `level`, `logger`, `message`, `task_id` (the task the log line was
written for, when there is one), `exc` (a traceback, scrubbed too).
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from contextvars import ContextVar
from typing import Any

import orjson

from streams.preprocess import Redactor

current_task_id: ContextVar[str | None] = ContextVar("llm_streams_task_id", default=None)


# A password in a URL's user part (`https://user:secret@registry:8081`), whoever wrote it.
URL_PASSWORD = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s:@]*:)[^@\s/]+@")


class Scrubber:
    def __init__(self, secrets: list[str]) -> None:
        # Longest first, so a key that contains another is replaced whole.
        self.secrets = sorted({s for s in secrets if len(s) >= 6}, key=len, reverse=True)
        self.redactor = Redactor()

    def __call__(self, text: str) -> str:
        for secret in self.secrets:
            if secret in text:
                text = text.replace(secret, "[SECRET]")
        if "@" in text:
            text = URL_PASSWORD.sub(r"\1[SECRET]@", text)
        return self.redactor.redact(text, Counter())


class TaskContext(logging.Filter):
    """Adds `task_id` (from the job running) to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.task_id = current_task_id.get()
        return True


class QuietReaders(logging.Filter):
    """Leaves out aiokafka's line for every `unsubscribe()` of a consumer ("Unsubscribed
    all topics or patterns and assigned partitions"): the worker's readers of its small
    topics (`kafka.scan.Follower`: the spend caps every 15 s, the drift baselines every
    30 s) let their partitions go after each read, a line every few seconds of an idle
    worker's log that says nothing. The group's assignments are said by the
    coordinator's logger."""

    ASSIGNED = "Unsubscribed all topics or patterns and assigned partitions"

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != self.ASSIGNED


class ScrubbedText(logging.Formatter):
    def __init__(self, secrets: list[str]) -> None:
        super().__init__("[%(asctime)s] [%(process)d] [%(levelname)s] %(name)s: %(message)s")
        self.scrub = Scrubber(secrets)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        task_id = getattr(record, "task_id", None)
        return self.scrub(f"{line} [task {task_id}]" if task_id else line)


class JsonLines(logging.Formatter):
    def __init__(self, secrets: list[str]) -> None:
        super().__init__()
        self.scrub = Scrubber(secrets)

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": self.scrub(record.getMessage()),
            "task_id": getattr(record, "task_id", None),
        }
        if record.exc_info:
            entry["exc"] = self.scrub(self.formatException(record.exc_info))
        return orjson.dumps(entry).decode()


def logging_config(level: str, fmt: str, secrets: list[str]) -> dict[str, Any]:
    """A `logging.config.dictConfig` for the worker (Faust/mode passes it on)."""
    formatter = JsonLines if fmt == "json" else ScrubbedText
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"task": {"()": TaskContext}, "readers": {"()": QuietReaders}},
        "formatters": {"default": {"()": formatter, "secrets": secrets}},
        "handlers": {
            "default": {
                "class": "logging.StreamHandler",
                "stream": "ext://sys.stdout",
                "formatter": "default",
                "filters": ["task"],
                "level": level.upper(),
            }
        },
        "root": {"level": level.upper(), "handlers": ["default"]},
        # Lines at info for every read of the small topics' readers (the budget sync every
        # 15 s, the drift baselines every 30 s: "Updating subscribed topics to ...", and
        # `QuietReaders`'); the group's assignments are said by the coordinator's logger.
        "loggers": {
            "aiokafka.consumer.subscription_state": {"level": "WARNING"},
            "aiokafka.consumer.consumer": {"filters": ["readers"]},
        },
    }


__all__ = ["JsonLines", "ScrubbedText", "Scrubber", "current_task_id", "logging_config"]
