"""Version diffs and backtrack selections, without a broker."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from streams.ops.backtrack import Selection
from streams.ops.diff import summarise

SCHEMA = {
    "type": "object",
    "properties": {
        "sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
        "confidence": {"type": "number"},
        "topics": {"type": "array", "items": {"type": "string"}},
        "summary": {"type": "string"},
    },
}


def test_diff_counts_flips_shifts_and_list_changes() -> None:
    pairs = [
        ({"sentiment": "positive", "confidence": 0.5, "topics": ["price"], "summary": "a"},
         {"sentiment": "negative", "confidence": 0.9, "topics": ["price"], "summary": "a"}),
        ({"sentiment": "positive", "confidence": 0.8, "topics": ["price", "delivery"],
          "summary": "b"},
         {"sentiment": "positive", "confidence": 0.6, "topics": ["delivery"], "summary": "c"}),
    ]  # fmt: skip
    by_name = {d.name: d for d in summarise(pairs, SCHEMA)}
    s = by_name["sentiment"]
    assert (s.kind, s.compared, s.changed) == ("label", 2, 1)
    assert dict(s.flips) == {("positive", "negative"): 1}
    c = by_name["confidence"]
    assert c.kind == "number" and c.changed == 2
    assert c.mean_shift == pytest.approx(0.1) and c.mean_abs_shift == pytest.approx(0.3)
    t = by_name["topics"]
    assert t.kind == "list" and t.changed == 1 and t.mean_jaccard == pytest.approx(0.75)
    assert by_name["summary"].kind == "other" and by_name["summary"].changed_share == 0.5


def test_fields_missing_on_both_sides_are_not_compared() -> None:
    by_name = {d.name: d for d in summarise([({"sentiment": "neutral"}, {"sentiment": "neutral"})],
                                            SCHEMA)}  # fmt: skip
    assert by_name["sentiment"].compared == 1 and by_name["sentiment"].changed == 0
    assert by_name["topics"].compared == 0 and by_name["topics"].mean_jaccard == 1.0


def test_a_selection_needs_a_criterion_and_all_must_hold() -> None:
    assert Selection().empty()
    state = {"task_id": "t1", "pipeline": "p", "prompt_version": "v2",
             "updated_at": "2026-11-29T10:00:00+00:00"}  # fmt: skip
    assert Selection(task_ids=frozenset({"t1"})).matches(state)
    assert not Selection(task_ids=frozenset({"t2"})).matches(state)
    assert Selection(pipeline="p", prompt_version="v2").matches(state)
    assert not Selection(pipeline="p", prompt_version="v1").matches(state)
    ten = datetime(2026, 11, 29, 10, tzinfo=UTC)
    assert Selection(since=ten).matches(state) and not Selection(until=ten).matches(state)
    assert not Selection(since=ten).matches({**state, "updated_at": "garbled"})
    # Not a text, or a time without its zone: once a TypeError that ended the backtrack.
    assert not Selection(since=ten).matches({**state, "updated_at": 1764410400})
    naive = {**state, "updated_at": "2026-11-29T10:00:00"}
    assert Selection(since=ten).matches(naive) and not Selection(until=ten).matches(naive)
