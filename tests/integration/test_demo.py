"""`llm-streams demo` as a newcomer runs it: the whole job on embedded defaults (Tansu,
the simulator, one worker), then — with --keep — a worker to look at until Ctrl-C, and
nothing left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import orjson


def test_demo_kept_up_shows_its_worker_until_ctrl_c_and_leaves_nothing(tmp_path: Path) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("LLM_STREAMS_", "OPENAI_")) or k == "LLM_STREAMS_KAFKA_JARS"
    }
    env.update({"TMPDIR": str(tmp_path), "COLUMNS": "300"})  # fmt: skip
    # A suite started in the background by a shell without job control ignores SIGINT,
    # and a child inherits that: the demo would never see its Ctrl-C. A handled signal
    # is reset to its default in the child, an ignored one is not: handled while it starts.
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:  # its own session: the broker and worker it starts are stopped with it, whatever
        demo = subprocess.Popen(
            [sys.executable, "-m", "streams.cli", "demo", "--count", "6", "--quiet", "--keep",
             "--timeout", "90"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
            start_new_session=True,
        )  # fmt: skip
    finally:
        signal.signal(signal.SIGINT, handler)
    assert demo.stdout is not None
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = demo.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip())
            if "Ctrl-C stops" in line:
                break
        out = "\n".join(lines)
        assert "Ctrl-C stops" in out, out
        assert _row(out, "results") == "6", out
        # The three malformed records, each category once (not invalid_input/invalid_input).
        assert _row(out, "dead letters") == "invalid_input: 3", out
        assert _row(out, "missing") == "0", out
        (url,) = re.findall(r"status --url (http://\S+/status\.json)", out)
        assert f"status {url.removesuffix('.json')}" in out  # the worker line names it too
        with urllib.request.urlopen(url, timeout=10) as answer:  # the worker is still up
            assert answer.status == 200
            assert isinstance(orjson.loads(answer.read()), dict)
        assert list(tmp_path.glob("llm-streams-demo-*"))  # in use while kept up
        demo.send_signal(signal.SIGINT)
        try:  # its output read to the end meanwhile: a full pipe must not hold its exit
            rest, _ = demo.communicate(timeout=60)
        except subprocess.TimeoutExpired as exc:
            logs = {p.name: p.read_text(errors="replace")[-3000:]
                    for p in tmp_path.glob("llm-streams-demo-*/*.log")}  # fmt: skip
            raise AssertionError(f"the demo did not stop within 60 s of Ctrl-C; it said "
                                 f"{exc.output!r}; {logs}") from None  # fmt: skip
        assert demo.returncode == 0, rest
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)  # the demo, its broker and its worker
            demo.wait()
        demo.stdout.close()
    assert not list(tmp_path.glob("llm-streams-demo-*"))  # cleaned up after itself


def _row(table: str, name: str) -> str | None:
    """The value of a row of the summary table."""
    found = re.search(rf"│ {name}\s+│ (.+?)\s+│", table)
    return found.group(1) if found else None
