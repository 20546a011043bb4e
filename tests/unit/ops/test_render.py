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
