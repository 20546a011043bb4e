"""`llm-streams replay --from-offset` says what it expected, whatever the text it gets."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from streams.cli import cli


@pytest.mark.parametrize("spec", ["x:1", "0:", "²:1", "0:¹"])
def test_an_offset_that_is_not_partition_colon_offset_is_refused_plainly(spec: str) -> None:
    # "²" and "¹" are digits to str.isdigit, not to int: once a ValueError's traceback.
    run = CliRunner().invoke(cli, ["replay", "--from-offset", spec])
    assert run.exit_code == 2, run.output
    assert f"expected PARTITION:OFFSET, got {spec!r}" in run.output


def test_what_went_wrong_is_printed_as_it_is() -> None:
    # A pipeline typed with brackets was a MarkupError's traceback, its name unsaid.
    run = CliRunner().invoke(cli, ["replay", "--pipeline", "a[/b]", "--from-offset", "0:0"])
    assert run.exit_code == 2, run.output
    assert "replay: unknown pipeline 'a[/b]'" in run.output
