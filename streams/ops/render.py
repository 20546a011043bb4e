"""One readable line per record of our topics, for `tail` and the demo."""

from __future__ import annotations

import textwrap

import orjson
from rich.markup import escape

_SENTIMENT_STYLE = {"positive": "green", "negative": "red", "mixed": "yellow", "neutral": "white"}


def describe(topic: str, key: bytes | None, value: bytes | None) -> str:
    """One readable line for a result, a dead letter or any JSON record."""
    try:
        data = orjson.loads(value) if value is not None else None
    except orjson.JSONDecodeError:
        return f"[dim]{topic}[/dim] {key!r} <{len(value or b'')} bytes, not JSON>"
    if isinstance(data, dict) and "output" in data and "result_key" in data:
        out = data["output"]
        label = str(out.get("sentiment", "?"))
        style = _SENTIMENT_STYLE.get(label, "white")
        topics = ",".join(out.get("topics", []))
        issues = "; ".join(
            f'{i.get("category")}: "{clip(str(i.get("evidence", "")), 40)}"'
            for i in out.get("issues", [])
        )
        return (
            f"[bold]{escape(str(data['task_id'])[:24]):<24}[/bold] [{style}]{label:<8}[/{style}] "
            f"{out.get('language', '?'):<3}{out.get('confidence', 0):.2f} [cyan]{topics}[/cyan] "
            f"{data.get('latency_ms', 0):>6.0f}ms {escape(issues)}"
        )
    if isinstance(data, dict) and "error" in data and "failed_at" in data:
        err = data["error"]
        category, code = err.get("category"), err.get("code")
        kind = category if code in (None, category) else f"{category}/{code}"
        return (
            f"[bold]{escape(str(data.get('task_id'))[:24]):<24}[/bold] "
            f"[magenta]dead letter[/magenta] {kind}: {escape(clip(str(err.get('message')), 100))}"
        )
    return (
        f"[dim]{topic}[/dim] {escape(repr(key))} {escape(clip(orjson.dumps(data).decode(), 160))}"
    )


def clip(text: str, width: int) -> str:
    """`text` on one line of at most `width` characters, cut between words (`…` marks the
    cut); a single word longer than the line is cut inside it."""
    line = " ".join(text.split())
    if len(line) <= width:
        return line
    cut = textwrap.shorten(line, width=width, placeholder=" …")
    return cut if cut != "…" else line[: width - 1] + "…"
