"""The pre-commit hooks run what `make lint` runs, no more and no less."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_pre_commit_runs_what_make_lint_runs() -> None:
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^lint:.*\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert recipe is not None
    lint = {line.strip().replace("$(BIN)/", ".venv/bin/") for line in recipe.group(1).splitlines()}
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    hooks = {hook["entry"] for repo in config["repos"] for hook in repo["hooks"]}
    assert hooks == lint
