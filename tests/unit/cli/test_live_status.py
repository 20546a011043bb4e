"""`llm-streams status` (no task): a status it cannot show is said in one line."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

import streams.cli.live as live
from streams.observability.metrics import Metrics
from streams.observability.status import StatusView

URL = "http://w-1:6066/status.json"


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        (lambda: orjson.loads(b"<html>"), "cannot read"),  # another service at that port
        (lambda: {"tasks": 1}, "no status this version can show"),  # another version's
        (lambda: ["a", "list"], "no status this version can show"),
    ],
)
def test_a_status_it_cannot_show_is_one_line_and_status_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], answer: Any, said: str
) -> None:
    # Once a JSONDecodeError, KeyError or TypeError traceback.
    monkeypatch.setattr(live, "fetch", lambda _url: answer())
    assert live.watch(URL, once=True, every_s=1) == 1
    out = capsys.readouterr().out
    assert said in out and "Traceback" not in out


def test_a_worker_of_this_version_is_shown(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    snap = StatusView(Metrics(), identity=lambda: {"host": "w-1"}).snapshot()
    monkeypatch.setattr(live, "fetch", lambda _url: orjson.loads(orjson.dumps(snap)))
    assert live.watch(URL, once=True, every_s=1) == 0
    assert "w-1" in capsys.readouterr().out


def test_a_version_named_with_brackets_is_shown_as_it_is(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A version's name is the pipeline file's: "v[/2]" was a MarkupError's traceback.
    snap = StatusView(Metrics(), identity=lambda: {"host": "w-1"}).snapshot()
    snap["versions"] = [{
        "pipeline": "p", "version": "v[/2]", "tasks": 3, "pass_rate": 1.0, "repair_rate": 0.0,
        "dead_letter_rate": 0.0, "review_share": 0.0, "latency_s": {"p50": 0.3, "p95": 0.4},
        "tokens_per_accepted": 120.0, "cost_per_accepted_usd": 0.0001,
    }]  # fmt: skip
    monkeypatch.setenv("COLUMNS", "200")  # the row on one line
    monkeypatch.setattr(live, "fetch", lambda _url: orjson.loads(orjson.dumps(snap)))
    assert live.watch(URL, once=True, every_s=1) == 0
    assert "p / v[/2]" in capsys.readouterr().out
