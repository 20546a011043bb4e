"""Output drift: label shares and PSI, KS for numbers and length, the null/default share,
the sliding window, stored profiles, and the gauges a worker exports."""

from __future__ import annotations

import math
from pathlib import Path

import orjson
import pytest
from prometheus_client import generate_latest

from streams.core.drift import (
    LENGTH,
    NONE,
    DriftMonitor,
    Profile,
    Window,
    compare,
    features,
    field_kinds,
    ks,
    psi,
)
from streams.observability.metrics import Metrics

ROOT = Path(__file__).resolve().parents[3]
COMMENTS = orjson.loads((ROOT / "schemas" / "comment-analysis.output.schema.json").read_bytes())
SCHEMA = {
    "type": "object",
    "required": ["label"],
    "properties": {
        "label": {"type": "string", "enum": ["a", "b"]},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["x", "y"]}},
        "score": {"type": "number"},
        "note": {"type": "string", "default": ""},
    },
}


def test_psi_and_ks_match_their_definitions() -> None:
    p, q = {"a": 0.5, "b": 0.5}, {"a": 0.9, "b": 0.1}
    expected = (0.5 - 0.9) * math.log(0.5 / 0.9) + (0.5 - 0.1) * math.log(0.5 / 0.1)
    assert psi(p, q) == pytest.approx(expected)
    assert psi(p, p) == 0.0
    assert psi({"a": 1.0}, {"b": 1.0}) > 10  # a value never seen before: floored, not infinite
    assert ks([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) == 0.0
    assert ks([1.0, 2.0], [3.0, 4.0]) == 1.0
    assert ks([1.0, 2.0, 3.0, 4.0], [3.0, 4.0, 5.0, 6.0]) == pytest.approx(0.5)


def test_the_comment_schema_gives_labels_lists_and_numbers() -> None:
    kinds = {k.name: k for k in field_kinds(COMMENTS)}
    assert kinds["sentiment"].kind == "label" and "mixed" in kinds["sentiment"].values
    assert kinds["topics"].kind == "labels" and NONE in kinds["topics"].values
    assert kinds["confidence"].kind == "number" and kinds[LENGTH].kind == "number"
    assert "summary" not in kinds  # required free text: nothing to measure


def test_null_and_default_shares_of_optional_fields() -> None:
    kinds = field_kinds(SCHEMA)
    p = Profile()
    for out in ({"label": "a", "note": ""}, {"label": "a", "note": None},
                {"label": "b", "note": "hi"}, {"label": "b", "tags": [], "score": 1}):  # fmt: skip
        p.add(features(out, kinds))
    # note: default "", null, given, missing (the same as null): 3 of 4 are empty.
    assert p.empty_ratio("note") == 0.75
    assert p.empty_ratio("tags") == 0.75 and p.shares("tags", ("x", "y", NONE))[NONE] == 1.0
    drift = {f.field: f for f in compare(p, p, kinds)}
    assert drift["note"].empty_ratio == drift["note"].baseline_empty_ratio == 0.75
    assert drift["label"].divergence == 0.0 and drift["label"].measure == "psi"
    assert drift["label"].empty_ratio is None  # required: no null share


def test_the_window_keeps_the_latest_answers_only() -> None:
    w = Window(field_kinds(SCHEMA), size=10)
    for _ in range(10):
        w.add({"label": "a", "score": 1.0})
    for _ in range(10):
        w.add({"label": "b", "score": 2.0})
    assert w.profile.answers == 10
    assert w.profile.shares("label", ("a", "b")) == {"a": 0.0, "b": 1.0}
    assert w.profile.numbers["score"] == [2.0] * 10


def test_a_stored_profile_compares_as_the_original() -> None:
    kinds = field_kinds(COMMENTS)
    before, after = Profile(), Profile()
    for i in range(300):
        before.add(features({"sentiment": "positive" if i % 3 else "negative",
                             "confidence": i / 300, "topics": []}, kinds))  # fmt: skip
        after.add(features({"sentiment": "negative", "confidence": 0.5, "topics": ["price"]},
                           kinds))  # fmt: skip
    stored = Profile.from_json(orjson.loads(orjson.dumps(before.to_json())))
    direct = {f.field: f.divergence for f in compare(after, before, kinds)}
    again = {f.field: f.divergence for f in compare(after, stored, kinds)}
    assert direct == again
    assert direct["sentiment"] > 0.15 and direct["topics"] > 0.15
    assert direct["confidence"] == pytest.approx(0.5, abs=0.01)


def test_the_worker_exports_shares_and_divergence_with_bounded_labels() -> None:
    monitor = DriftMonitor({"comments": COMMENTS}, size=100)
    kinds = field_kinds(COMMENTS)
    base = Profile()
    for _ in range(50):
        base.add(features({"sentiment": "positive", "confidence": 0.9, "topics": []}, kinds))
    monitor.baselines[("comments", "v1")] = base
    for i in range(50):
        monitor.observe("comments", "v1", {"sentiment": "negative" if i % 2 else "positive",
                                           "confidence": 0.9, "topics": []})  # fmt: skip
    monitor.observe("unknown-pipeline", "v1", {"sentiment": "positive"})  # not watched
    monitor.observe("comments", "v2", {"sentiment": "mixed", "confidence": 0.1, "topics": []})
    metrics = Metrics()
    metrics.watch_drift(monitor.rows)
    text = generate_latest(metrics.registry).decode()
    expected_psi = psi({"positive": 0.5, "negative": 0.5}, {"positive": 1.0})
    line = ('llm_streams_drift_divergence{field="sentiment",measure="psi",pipeline="comments",'
            'version="v1"}')  # fmt: skip
    value = next(float(x.split()[-1]) for x in text.splitlines() if x.startswith(line))
    assert value == pytest.approx(expected_psi)
    assert ('llm_streams_drift_share{field="sentiment",pipeline="comments",value="negative",'
            'version="v1"} 0.5') in text  # fmt: skip
    assert 'llm_streams_drift_window_answers{pipeline="comments",version="v2"} 1.0' in text
    assert "unknown-pipeline" not in text
    # v2 has no baseline: shares, no divergence.
    assert 'measure="psi",pipeline="comments",version="v2"' not in text
