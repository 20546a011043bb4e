"""The `llm-streams` command line: one module per group of commands (`run`, `data`, `ab`,
`pipelines`), over what they share (`base`)."""

from __future__ import annotations

from streams.cli import ab, data, pipelines, run  # noqa: F401  # each registers its commands
from streams.cli.base import cli


def main() -> None:
    cli()


__all__ = ["cli", "main"]
