"""`llm-streams erase` asks for a source key that is not UTF-8 by its bytes: the request
the worker reads carries them, and the text the worker reads the key as."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import pytest
from click.testing import CliRunner

from streams.cli import cli
from streams.contract.records import EraseRequest


class Publisher:
    sent: list[bytes] = []

    def __init__(self, *_: Any) -> None:
        pass

    async def __aenter__(self) -> Publisher:
        return self

    async def __aexit__(self, *_: Any) -> None:
        return None

    async def erase(self, task_id: str, pipeline: str, source_key: Any = None,
                    **kw: Any) -> None:  # fmt: skip
        request = EraseRequest(task_id=task_id, pipeline=pipeline, source_key=source_key, **kw)
        self.sent.append(request.wire())


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    import streams.cli.data as data
    import streams.kafka.publisher as publisher

    Publisher.sent = []
    monkeypatch.setattr(publisher, "TaskPublisher", Publisher)
    monkeypatch.setattr(data, "on_kafka", lambda _settings, work: asyncio.run(work))
    return Publisher.sent


def test_a_source_key_that_is_not_utf8_is_given_by_its_bytes(sent: list[bytes]) -> None:
    raw = base64.b64encode((255).to_bytes(8, "big")).decode()
    erase = ["erase", "--task-id", f"base64:{raw}", "--pipeline", "comment-analysis"]
    run = CliRunner().invoke(cli, [*erase, "--source-key-base64", raw])
    assert run.exit_code == 0, run.output
    (request,) = [EraseRequest.model_validate_json(value) for value in sent]
    assert request.source_key_base64 == raw and request.source_key == f"base64:{raw}"
    for bad in (["--source-key-base64", "no base64!"],
                ["--source-key-base64", raw, "--source-key", "k"]):  # fmt: skip
        run = CliRunner().invoke(cli, [*erase, *bad])
        assert run.exit_code == 2 and len(sent) == 1, run.output
