"""`llm-streams status TASK_ID` prints a stored state as text, whatever it holds."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from click.testing import CliRunner

from streams.cli import cli

STATE: dict[str, Any] = {
    "task_id": "t-1",
    "status": "dead_lettered",
    "last_error": {"code": "not_found", "message": "HTTP 404: no route [/v1/chat/completions]"},
    "history": [
        {"at": "2026-12-07T10:00:00.000Z", "status": "dead_lettered", "note": "[/bold] [red]"},
        {"at": 1764410400, "status": None},  # another version's shape
        "not an entry",
    ],
}


@pytest.fixture
def stored(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    import streams.cli.data as data
    import streams.ops.redrive as redrive

    async def task_state(_settings: Any, task_id: str) -> dict[str, Any] | None:
        return {**STATE, "history": list(STATE["history"])} if task_id == "t-1" else None

    monkeypatch.setattr(redrive, "task_state", task_state)
    monkeypatch.setattr(data, "on_kafka", lambda _settings, work: asyncio.run(work))
    return STATE


def test_a_state_with_brackets_and_odd_history_is_printed_as_it_is(stored: Any) -> None:
    # Once a MarkupError (the provider's "[/v1/...]"), a NotRenderableError (a number)
    # and a TypeError (an entry that is no object): a traceback instead of the state.
    run = CliRunner().invoke(cli, ["status", "t-1"])
    assert run.exit_code == 0, run.output
    assert "no route [/v1/chat/completions]" in run.output
    assert "[/bold] [red]" in run.output and "1764410400" in run.output
    missing = CliRunner().invoke(cli, ["status", "t-2"])
    assert missing.exit_code == 1 and "no state for task 't-2'" in missing.output
