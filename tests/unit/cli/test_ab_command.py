"""`llm-streams ab report` prints version names as they are."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from click.testing import CliRunner

from streams.cli import cli
from streams.ops.ab import VersionEvidence


def test_a_version_named_with_brackets_is_printed_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Version names are the keys of a pipeline's `versions:` and what result records say:
    # "v[/2]" among them was a MarkupError that ended the report after it was computed.
    import streams.cli.ab as ab_cli
    import streams.ops.ab as ab

    found = {name: VersionEvidence(name) for name in ("v1", "v[/2]")}
    for n, evidence in enumerate(found.values()):
        for i in range(20):
            evidence.add({"task_id": f"t{i}", "cost_usd": 0.001, "output": {"n": n}}, "result")

    async def gathered(*_: Any, **__: Any) -> dict[str, VersionEvidence]:
        return found

    monkeypatch.setattr(ab, "gather", gathered)
    monkeypatch.setattr(ab_cli, "on_kafka", lambda _settings, work: asyncio.run(work))
    run = CliRunner().invoke(cli, ["ab", "report", "--pipeline", "comment-analysis"])
    assert run.exit_code == 0, run.output
    assert "v[/2]" in run.output and "pass rate v1 − v[/2]" in run.output
