"""The `worker` command's options and the `.env` file every command reads."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from streams.cli import cli
from streams.cli.base import read_env_file
from streams.settings import Settings


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[Settings]:
    """The settings the worker would have run with (the worker itself is not started)."""
    seen: list[Settings] = []
    import streams.worker.run as run

    monkeypatch.setattr(run, "run_worker", lambda settings, *a, **k: seen.append(settings))
    return seen


def test_faust_style_options_win_over_their_variables(
    monkeypatch: pytest.MonkeyPatch, started: list[Settings]
) -> None:
    monkeypatch.setenv("LLM_STREAMS_WEB_PORT", "7000")
    monkeypatch.setenv("LLM_STREAMS_LOG_LEVEL", "info")
    run = CliRunner().invoke(
        cli, ["worker", "-l", "DEBUG", "--web-port", "7100", "--web-bind", "0.0.0.0", "--json-logs"]
    )
    assert run.exit_code == 0, run.output
    (settings,) = started
    assert (settings.log_level, settings.web_port, settings.web_bind, settings.log_format) == (
        "debug", 7100, "0.0.0.0", "json",
    )  # fmt: skip


def test_without_options_the_variables_hold(
    monkeypatch: pytest.MonkeyPatch, started: list[Settings]
) -> None:
    monkeypatch.setenv("LLM_STREAMS_WEB_PORT", "7000")
    assert CliRunner().invoke(cli, ["worker"]).exit_code == 0
    assert started[0].web_port == 7000 and started[0].log_format == "text"


def test_a_typo_stops_the_worker_with_one_line(
    monkeypatch: pytest.MonkeyPatch, started: list[Settings]
) -> None:
    monkeypatch.setenv("LLM_STREAMS_BATCHSIZE", "5")
    run = CliRunner().invoke(cli, ["worker"])
    assert run.exit_code == 2 and not started
    assert "LLM_STREAMS_BATCHSIZE is no setting (did you mean LLM_STREAMS_BATCH__SIZE?)" in (
        run.output
    )


def test_env_file_fills_what_the_environment_does_not_set(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, started: list[Settings]
) -> None:
    (tmp_path / ".env").write_text(
        "# the user's own\n"
        "OPENAI_API_KEY=sk-from-dotenv\n"
        "LLM_STREAMS_BATCH__SIZE=9\n"
        'LLM_STREAMS_TOPICS__TASKS="shop.reviews"\n'
        "LLM_STREAMS_WEB_PORT=7001\n"
    )
    monkeypatch.setenv("LLM_STREAMS_WEB_PORT", "7000")  # the environment wins
    for name in ("OPENAI_API_KEY", "LLM_STREAMS_BATCH__SIZE", "LLM_STREAMS_TOPICS__TASKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    try:
        assert CliRunner().invoke(cli, ["worker"]).exit_code == 0
    finally:
        for name in ("OPENAI_API_KEY", "LLM_STREAMS_BATCH__SIZE", "LLM_STREAMS_TOPICS__TASKS"):
            os.environ.pop(name, None)  # read_env_file set them outside monkeypatch
    (settings,) = started
    key: Any = settings.llm.api_key
    assert key.get_secret_value() == "sk-from-dotenv"
    assert (settings.batch.size, settings.topics.tasks, settings.web_port) == (
        9, "shop.reviews", 7000,
    )  # fmt: skip


def test_no_env_file_reads_nothing(tmp_path: Path) -> None:
    before = dict(os.environ)
    read_env_file(tmp_path / ".env")
    assert dict(os.environ) == before
