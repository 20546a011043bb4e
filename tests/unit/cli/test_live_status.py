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
