"""`llm-streams drift` prints the shares of what the model wrote as text."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from click.testing import CliRunner

from streams.cli import cli
from streams.core.drift import FieldDrift
from streams.ops.drift import VersionDrift


def test_a_label_the_model_wrote_with_brackets_is_printed_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A list field's values are the model's free text: "[/b]" among them was a
    # MarkupError that ended the command after the figures were computed.
    import streams.cli.pipelines as pipelines
    import streams.ops.drift as drift

    field = FieldDrift("topics", "labels", "psi", 0.31, {"[/b] zip": 0.6, "price": 0.4},
                       {"price": 1.0}, None, None)  # fmt: skip

    async def computed(*_: Any, **__: Any) -> tuple[list[VersionDrift], list[str]]:
        return [VersionDrift("v1", 10, 10, [field])], []

    monkeypatch.setattr(drift, "drift", computed)
    monkeypatch.setattr(pipelines, "on_kafka", lambda _settings, work: asyncio.run(work))
    run = CliRunner().invoke(cli, ["drift", "--pipeline", "comment-analysis"])
    assert run.exit_code == 0, run.output
    assert "[/b] zip 60%" in run.output and "psi 0.310  DRIFT" in run.output
