"""One readable line per record of our topics, for `tail` and the demo."""

from __future__ import annotations

import textwrap
from typing import Any

import orjson
from rich.markup import escape

from streams.contract.records import field_number

_SENTIMENT_STYLE = {"positive": "green", "negative": "red", "mixed": "yellow", "neutral": "white"}


def describe(topic: str, key: bytes | None, value: bytes | None) -> str:
    """One readable line for a result, a dead letter or any record — of any pipeline,
    whatever its fields hold: never raises."""
    where = f"[dim]{escape(topic)}[/dim] {escape(repr(key))}"
    try:
        data = orjson.loads(value) if value is not None else None
    except orjson.JSONDecodeError:
        return f"{where} <{len(value or b'')} bytes, not JSON>"
    if isinstance(data, dict) and "result_key" in data and isinstance(data.get("output"), dict):
        return _result(data, data["output"])
    if isinstance(data, dict) and isinstance(data.get("error"), dict) and "failed_at" in data:
        err = data["error"]
        category, code = err.get("category"), err.get("code")
        kind = category if code in (None, category) else f"{category}/{code}"
        return (
            f"{_task(data)} [magenta]dead letter[/magenta] "
            f"{escape(str(kind))}: {escape(clip(str(err.get('message')), 100))}"
        )
    return f"{where} {escape(clip(orjson.dumps(data).decode(), 160))}"


def _task(data: dict[str, Any]) -> str:
    return f"[bold]{escape(clip(str(data.get('task_id')), 24)):<24}[/bold]"


def _result(data: dict[str, Any], out: dict[str, Any]) -> str:
    """A result's line: comment-analysis's fields when its output has them (other types
    read as absent), its output as JSON for any other pipeline."""
    took = f"{field_number(data.get('latency_ms')):>6.0f}ms"
    label = out.get("sentiment")
    if not isinstance(label, str):
        return f"{_task(data)} {escape(clip(orjson.dumps(out).decode(), 120))} {took}"
    style = _SENTIMENT_STYLE.get(label, "white")
    topics = ",".join(str(t) for t in _listed(out.get("topics")))
    issues = "; ".join(
        f'{i.get("category")}: "{clip(str(i.get("evidence", "")), 40)}"'
        for i in _listed(out.get("issues")) if isinstance(i, dict)
    )  # fmt: skip
    said = out.get("language")
    language = said if isinstance(said, str) else "?"
    return (
        f"{_task(data)} [{style}]{escape(clip(label, 8)):<8}[/{style}] "
        f"{escape(clip(language, 3)):<3}{field_number(out.get('confidence')):.2f} "
        f"[cyan]{escape(topics)}[/cyan] {took} {escape(issues)}"
    )


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def clip(text: str, width: int) -> str:
    """`text` on one line of at most `width` characters, cut between words (`…` marks the
    cut); a single word longer than the line is cut inside it."""
    line = " ".join(text.split())
    if len(line) <= width:
        return line
    cut = textwrap.shorten(line, width=width, placeholder=" …")
    return cut if cut != "…" else line[: width - 1] + "…"
