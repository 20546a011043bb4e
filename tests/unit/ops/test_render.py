"""The one line `tail` and the demo print per record."""

from __future__ import annotations

import orjson
from rich.console import Console

from streams.ops.render import clip, describe


def _shown(line: str) -> str:
    console = Console(width=400, record=True, color_system=None)
    console.print(line, highlight=False)
    return console.export_text().strip()


def _letter(category: str, code: str, message: str) -> bytes:
    return orjson.dumps({"task_id": "t-1", "failed_at": "2026-12-01T00:00:00Z",
                         "error": {"category": category, "code": code, "message": message}})  # fmt: skip


def test_a_dead_letter_names_its_category_once_when_the_code_says_the_same() -> None:
    line = _shown(
        describe("llm-dead-letters", b"t-1", _letter("invalid_input", "invalid_input", "x"))
    )
    assert "invalid_input: x" in line and "invalid_input/invalid_input" not in line
    line = _shown(describe("llm-dead-letters", b"t-1", _letter("invalid_input", "bad_json", "x")))
    assert "invalid_input/bad_json: x" in line


def test_a_long_reason_is_cut_between_words_and_marked() -> None:
    reason = "the comment field is missing from the record " * 5
    line = _shown(describe("llm-dead-letters", b"t-1", _letter("invalid_input", "missing", reason)))
    shown = line.split("invalid_input/missing: ", 1)[1]
    assert shown.endswith(" …") and len(shown) <= 100
    assert reason.startswith(shown.removesuffix(" …"))  # whole words only


def test_markup_in_record_data_is_printed_as_written() -> None:
    line = _shown(
        describe("llm-dead-letters", b"t-1", _letter("invalid_input", "x", "[red]no[/red] [b]"))
    )
    assert "[red]no[/red] [b]" in line


def test_clip() -> None:
    assert clip("a  b\\nc", 10) == "a b\\nc"
    assert clip("one two three four", 12) == "one two …"
    assert clip("x" * 50, 10) == "x" * 9 + "…"  # one word longer than the line
    assert clip("line\nbreaks\tand  tabs", 40) == "line breaks and tabs"


def _result(output: object, **more: object) -> bytes:
    return orjson.dumps({"task_id": "t-9", "result_key": "k", "output": output,
                         "latency_ms": 312.4, **more})  # fmt: skip


def test_any_pipelines_result_and_any_record_make_a_line_without_raising() -> None:
    """`tail` of a user's own pipeline: its outputs have other fields (or the shipped
    ones with other types), and a record or key may hold anything; each still makes a
    line (before, a non-number confidence, a null language or an issue that is not an
    object raised, and `tail` stopped)."""
    odd = [
        _result({"label": "spam", "score": 3}),
        _result({"sentiment": "negative", "confidence": "high", "language": None}),
        _result({"sentiment": "x", "topics": [1, None], "issues": ["late", 2]}),
        _result({"sentiment": "positive"}, latency_ms=None, task_id=None),
        _result(["not", "an", "object"]),
        orjson.dumps({"task_id": "t-1", "failed_at": "x", "error": "not an object"}),
        orjson.dumps([1, 2, 3]),
        b"\xff\xfe not json",
    ]
    for value in odd:
        for key in (b"t-9", b"[/bold] [/]", None, b"\xff"):
            line = _shown(describe("llm-results", key, value))
            assert line  # printed, whatever it holds
    line = _shown(describe("llm-results", b"t-9", odd[0]))
    assert "t-9" in line and '"label":"spam"' in line and "312ms" in line
    line = _shown(describe("llm-results", b"t-9", odd[1]))
    assert "negative" in line and "high" not in line  # the shipped shape, its numbers read
    assert "[/]" in _shown(describe("llm-results", b"[/]", b"\xff"))


def test_a_comment_analysis_result_keeps_its_line() -> None:
    output = {"sentiment": "negative", "confidence": 0.91, "topics": ["delivery", "price"],
              "issues": [{"category": "delivery", "evidence": "came late"}], "language": "en",
              "summary": "late"}  # fmt: skip
    line = _shown(describe("llm-results", b"t-9", _result(output)))
    assert line.startswith("t-9")
    for part in ("negative", "en", "0.91", "delivery,price", "312ms", 'delivery: "came late"'):
        assert part in line
