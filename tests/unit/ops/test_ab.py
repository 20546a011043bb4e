"""A/B statistics, the promotion guard and the pipeline file rewrite."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from streams.contract.evaluation import Evaluation, PromotionGuard, verdict
from streams.observability.metrics import Metrics
from streams.observability.page import render_html
from streams.observability.status import StatusView
from streams.ops.ab import (
    Agreement,
    PromotionRefused,
    Ratio,
    VersionEvidence,
    agree,
    agreements,
    decision,
    decision_line,
    guard,
    new_split,
    rate_difference,
    report,
    rewrite,
    rivals_of,
    wilson,
)
from streams.pipelines.registry import PipelineRegistry

ROOT = Path(__file__).resolve().parents[3]


def test_wilson_interval_matches_published_values() -> None:
    # Newcombe (1998), table I: 81/263 -> 0.2553 to 0.3662; 0/10 -> 0 to 0.2775.
    lo, hi = wilson(81, 263)
    assert (round(lo, 4), round(hi, 4)) == (0.2553, 0.3662)
    lo, hi = wilson(0, 10)
    assert lo == 0.0 and round(hi, 4) == 0.2775
    assert wilson(0, 0) == (0.0, 1.0)


def test_rate_difference_matches_newcombe_method_10() -> None:
    # Newcombe (1998), table II, example (a): 56/70 - 48/80 = 0.2000, 0.0524 to 0.3339.
    d, lo, hi = rate_difference(56, 70, 48, 80)
    assert (round(d, 4), round(lo, 4), round(hi, 4)) == (0.2, 0.0524, 0.3339)


def ratio(xs: list[float], ys: list[float]) -> tuple[float, float, float] | None:
    summed = Ratio()
    for x, y in zip(xs, ys, strict=True):
        summed.add(x, y)
    return summed.interval()


def test_ratio_interval_is_the_ratio_of_sums_with_a_spread() -> None:
    costs = [0.002, 0.004, 0.0, 0.003]  # the third task failed before any call
    answered = [1.0, 1.0, 0.0, 1.0]
    r, lo, hi = ratio(costs, answered) or (0, 0, 0)
    assert r == pytest.approx(0.009 / 3)
    assert lo < r < hi
    # The delta method over the units themselves, as the sums give it.
    n, my = 4, 3 / 4
    var = sum((x - r * y) ** 2 for x, y in zip(costs, answered, strict=True)) / (n - 1)
    assert hi - r == pytest.approx(1.959964 * (var / n) ** 0.5 / my)
    assert ratio([], []) is None
    assert ratio([0.1], [0.0]) is None
    assert ratio([0.1], [1.0]) == (0.1, 0.1, 0.1)


def test_verdicts_and_the_figures_they_add_up_to() -> None:
    assert verdict("result", None, 0, False) == "pass"
    assert verdict("result", None, 2, False) == "repaired"
    assert verdict("result", None, 0, True) == "cached"
    assert verdict("dead_letter", "invalid_output", 2, False) == "rejected"
    assert verdict("dead_letter", "timeout", 0, False) == "failed"
    e = Evaluation()
    for v in ["pass"] * 6 + ["repaired"] * 2 + ["rejected", "failed", "cached"]:
        e.add(v, cost_usd=0.01, tokens=100)
    assert e.tasks == 11 and e.judged == 9 and e.accepted == 9
    assert e.pass_rate == pytest.approx(6 / 9)
    assert e.repair_rate == pytest.approx(2 / 9)
    assert e.dead_letter_rate == pytest.approx(2 / 11)
    assert e.cost_per_accepted == pytest.approx(0.11 / 9)


def evidence(version: str, passed: int, rejected: int, label: str = "positive") -> VersionEvidence:
    ev = VersionEvidence(version)
    for i in range(passed):
        ev.add({"task_id": f"t{i}", "cost_usd": 0.001, "usage": {"prompt_tokens": 10,
                "completion_tokens": 5}, "output": {"sentiment": label}}, "result")  # fmt: skip
    for i in range(rejected):
        ev.add({"task_id": f"x{i}", "cost_usd": 0.002,
                "error": {"category": "invalid_output"}}, "dead_letter")  # fmt: skip
    return ev


def test_the_guard_refuses_a_worse_version_and_accepts_a_better_one() -> None:
    found = {"v1": evidence("v1", 190, 10), "v2": evidence("v2", 140, 60)}
    with pytest.raises(PromotionRefused, match="significantly worse than v1"):
        guard(found, "v2", ["v1"])
    guard(found, "v1", ["v2"])
    # Close rates: no significant difference, so no refusal.
    guard({"v1": evidence("v1", 95, 5), "v2": evidence("v2", 93, 7)}, "v2", ["v1"])
    with pytest.raises(PromotionRefused, match="no answered tasks"):
        guard(found, "v3", ["v1"])


def priced(version: str, n: int, cost: float) -> VersionEvidence:
    """`n` tasks answered at about `cost` each (+-10%, so the interval has a spread)."""
    ev = VersionEvidence(version)
    for i in range(n):
        ev.add({"task_id": f"t{i}", "cost_usd": cost * (0.9 + 0.05 * (i % 5)),
                "output": {"sentiment": "positive"}}, "result")  # fmt: skip
    return ev


def test_the_guard_wants_enough_judged_tasks() -> None:
    found = {"v1": evidence("v1", 190, 10), "v2": evidence("v2", 20, 0)}
    with pytest.raises(PromotionRefused, match=r"20 judged task\(s\), fewer than the 30"):
        guard(found, "v2", ["v1"])
    guard(found, "v2", ["v1"], PromotionGuard(min_judged=20))


def test_the_guard_refuses_a_version_that_costs_significantly_more() -> None:
    found = {"v1": priced("v1", 200, 0.001), "v2": priced("v2", 200, 0.002)}
    with pytest.raises(PromotionRefused, match=r"costs significantly more .* than v1"):
        guard(found, "v2", ["v1"])
    guard(found, "v1", ["v2"])  # the cheaper one
    guard(found, "v2", ["v1"], PromotionGuard(max_cost_increase=1.5))  # 2x is within 2.5x
    guard(found, "v2", ["v1"], PromotionGuard(max_cost_increase=float("inf")))
    # 10% dearer is within the default 25%; a rival with no price says nothing.
    guard({"v1": priced("v1", 200, 0.001), "v2": priced("v2", 200, 0.0011)}, "v2", ["v1"])
    guard({"v1": priced("v1", 200, 0.0), "v2": priced("v2", 200, 0.002)}, "v2", ["v1"])
    # Few tasks, wide intervals: 2x dearer is not shown, so not refused on cost.
    few = {"v1": priced("v1", 30, 0.001), "v2": VersionEvidence("v2")}
    for i in range(30):
        few["v2"].add({"task_id": f"t{i}", "cost_usd": 0.006 if i % 3 == 0 else 0.0,
                       "output": {}}, "result")  # fmt: skip
    guard(few, "v2", ["v1"])


def test_the_decision_records_the_guard_and_the_cost_intervals() -> None:
    found = {"v1": priced("v1", 200, 0.001), "v2": priced("v2", 200, 0.002)}
    record = decision("comment-analysis", "v2", 1.0, "why", found, by="me", forced=True,
                      before={}, after={},
                      rules=PromotionGuard(min_judged=50, max_cost_increase=float("inf")))  # fmt: skip
    assert record["guard"] == {"min_judged": 50, "max_cost_increase": None}
    low, high = record["evidence"]["v2"]["cost_per_accepted_ci"]
    assert low < record["evidence"]["v2"]["cost_per_accepted_usd"] < high
    assert decision("p", "v1", 1.0, "why", found, by="me", forced=False, before={},
                    after={})["guard"] == {"min_judged": 30, "max_cost_increase": 0.25}  # fmt: skip


def test_the_report_shows_rates_intervals_and_agreement() -> None:
    schema = {"properties": {"sentiment": {"type": "string", "enum": ["positive", "negative"]}}}
    found = {"v1": evidence("v1", 190, 10), "v2": evidence("v2", 140, 60, label="negative")}
    agree(found, schema)
    data = report(found)
    v1, v2 = data["versions"]
    assert v1["pass_rate"] == pytest.approx(0.95) and v2["pass_rate"] == pytest.approx(0.7)
    assert v1["pass_rate_ci"][0] < 0.95 < v1["pass_rate_ci"][1]
    (pair,) = data["pairs"]
    diff = pair["pass_rate_difference"]
    assert diff["value"] == pytest.approx(0.25) and diff["ci"][0] > 0
    (agreed,) = pair["agreement"]
    # Tasks t0..t139 answered by both, with opposite labels.
    assert (agreed["label"], agreed["compared"], agreed["same"]) == ("sentiment", 140, 0)
    assert agreements(found["v2"], found["v1"]) == [Agreement("sentiment", 0, 140)]
    assert found["v1"].outputs == {}  # counted, then let go
    # The next partition's tasks add to the counts.
    more = {"v1": evidence("v1", 10, 0), "v2": evidence("v2", 10, 0)}
    found["v1"].outputs, found["v2"].outputs = more["v1"].outputs, more["v2"].outputs
    agree(found, schema)
    assert agreements(found["v1"], found["v2"]) == [Agreement("sentiment", 10, 150)]


def test_a_version_edited_in_place_during_its_test_is_said_and_not_promoted() -> None:
    """v2 did well; its prompt was then "fixed" in place and promote was run: the figures
    were the old v2's, the file's v2 never measured — and the guard let it through. Results
    made under another definition than the file's now are said and refuse the promotion;
    once its tasks are answered again under the file's (their latest results), it passes."""
    shipped = PipelineRegistry.load(ROOT / "pipelines", ROOT / "schemas")
    now = shipped.get("comment-analysis").version("v1")  # stands for the file's v2
    found = {"v1": evidence("v1", 150, 50), "v2": VersionEvidence("v2")}
    for i in range(200):
        found["v2"].add({"task_id": f"t{i}", "cost_usd": 0.001, "prompt_digest": "old",
                         "output": {"sentiment": "positive"}}, "result")  # fmt: skip
    found["v2"].add({"task_id": "t-legacy", "output": {}}, "result")  # before the field
    guard(found, "v2", ["v1"])  # what it did: nothing said
    with pytest.raises(PromotionRefused, match=r"200 of v2's 200 results .* another definition "
                       rf"than the file's now \({now.digest}\)"):  # fmt: skip
        guard(found, "v2", ["v1"], now=now)
    data = report(found, {"v2": now})
    v2 = data["versions"][1]
    assert (v2["definition"], v2["results_by_definition"], v2["results_made_otherwise"]) == (
        now.digest, {"old": 200}, 200)  # fmt: skip
    assert data["versions"][0]["results_made_otherwise"] == 0  # v1 not in the file: not said
    again = {"v1": found["v1"], "v2": VersionEvidence("v2")}
    for i in range(200):
        again["v2"].add({"task_id": f"t{i}", "cost_usd": 0.001, "prompt_digest": now.digest,
                         "output": {"sentiment": "positive"}}, "result")  # fmt: skip
    guard(again, "v2", ["v1"], now=now)
    record = decision("p", "v2", 1.0, "why", found, by="me", forced=True, before={},
                      after={}, definition=now.digest)  # fmt: skip
    assert record["prompt_digest"] == now.digest


def test_a_staged_versions_results_of_a_release_whose_digest_left_the_stages_out_pass() -> None:
    """A staged version's digest covers its stages since 534ad03; its results before carry
    the version's own digest. They are not said to be of another definition (what the
    stages were then is not known), or every staged pipeline's A/B stood refused."""
    triage = PipelineRegistry.load(ROOT / "pipelines", ROOT / "schemas").get("comment-triage")
    now = triage.version("v1")
    assert not now.made_otherwise(now.own_digest) and not now.made_otherwise(now.digest)
    assert now.made_otherwise("0123456789abcdef")
    plain = PipelineRegistry.load(ROOT / "pipelines", ROOT / "schemas").get("comment-analysis")
    assert plain.version("v1").own_digest == plain.version("v1").digest


def test_new_split_gives_the_share_and_keeps_the_others_proportions() -> None:
    assert new_split({"v1": 0.5, "v2": 0.5}, "v1", "v2", 1.0) == {"v2": 1.0}
    assert new_split({"v1": 0.6, "v2": 0.2, "v3": 0.2}, "v1", "v2", 0.5) == {
        "v2": 0.5, "v1": 0.375, "v3": 0.125}  # fmt: skip
    assert new_split(None, "v1", "v2", 0.1) == {"v2": 0.1, "v1": 0.9}


@pytest.fixture
def ab_pipeline(tmp_path: Path) -> Path:
    """comment-analysis with a second version and a 50/50 split, in a file of its own."""
    src = (ROOT / "pipelines" / "comment-analysis.yaml").read_text()
    data = yaml.safe_load(src)
    v2 = dict(data["versions"]["v1"], system=data["versions"]["v1"]["system"] + "Be terse.\n")
    text = (
        src
        + "  v2:\n"
        + "\n".join("    " + line for line in yaml.safe_dump(v2, allow_unicode=True).splitlines())
    )
    text += "\ntraffic:  # half and half while we decide\n  v1: 0.5\n  v2: 0.5\n"
    directory = tmp_path / "pipelines"
    directory.mkdir()
    path = directory / "comment-analysis.yaml"
    path.write_text(text)
    return path


def test_rewrite_keeps_comments_and_refuses_nothing_valid(ab_pipeline: Path) -> None:
    before, after = rewrite(ab_pipeline, "v2", 1.0, write=False)
    assert "v2: 0.5" in ab_pipeline.read_text()  # a check only
    assert before == {"traffic": {"v1": 0.5, "v2": 0.5}, "default_version": "v1"}
    assert after == {"traffic": {"v2": 1.0}, "default_version": "v2"}
    rewrite(ab_pipeline, "v2", 1.0)
    text = ab_pipeline.read_text()
    assert "# Every issue's evidence must be a verbatim quote of the comment." in text
    loaded = PipelineRegistry.load(ab_pipeline.parent, ROOT / "schemas").get("comment-analysis")
    assert loaded.spec.traffic == {"v2": 1.0} and loaded.spec.default_version == "v2"
    assert rivals_of(loaded.spec, "v1") == ["v2"]
    rewrite(ab_pipeline, "v1", 0.25)
    loaded = PipelineRegistry.load(ab_pipeline.parent, ROOT / "schemas").get("comment-analysis")
    assert loaded.spec.traffic == {"v1": 0.25, "v2": 0.75}
    assert loaded.spec.default_version == "v2"


def test_rewrite_of_an_unknown_version_fails_and_leaves_the_file(ab_pipeline: Path) -> None:
    original = ab_pipeline.read_text()
    with pytest.raises(ValueError, match="not in versions"):
        rewrite(ab_pipeline, "v9", 1.0)
    assert ab_pipeline.read_text() == original
    shutil.rmtree(ab_pipeline.parent)


def test_status_shows_each_versions_figures() -> None:
    metrics = Metrics()
    for v, n_pass, n_rejected in (("v1", 9, 1), ("v2", 5, 5)):
        for i in range(n_pass + n_rejected):
            metrics.evaluated(
                "comment-analysis", v, "pass" if i < n_pass else "rejected", seconds=0.3,
                prompt_tokens=100, completion_tokens=50, cost_usd=0.001, reviewed=i == 0,
            )  # fmt: skip
    snap = StatusView(metrics).snapshot()
    v1, v2 = snap["versions"]
    assert (v1["version"], v1["tasks"], v1["pass_rate"]) == ("v1", 10, 0.9)
    assert (v2["version"], v2["pass_rate"], v2["dead_letter_rate"]) == ("v2", 0.5, 0.5)
    assert v1["cost_per_accepted_usd"] == pytest.approx(0.01 / 9)
    assert v1["review_share"] == pytest.approx(1 / 9, abs=1e-4)
    assert 0.25 <= v1["latency_s"]["p50"] <= 0.5
    page = render_html(snap)
    assert 'data-metric="version:comment-analysis/v2:pass_rate" data-value="0.5">50.0%<' in page


def test_odd_records_count_as_zero_and_do_not_stop_the_report() -> None:
    # Another version's shape or a hand-made record: once an AttributeError (usage a text),
    # a ValueError (cost a word) or a KeyError (no task id) that ended `ab report`.
    ev = VersionEvidence("v1")
    ev.add({"task_id": "t1", "cost_usd": "free", "usage": "n/a", "rejected_answers": "2",
            "output": {"sentiment": "positive"}}, "result")  # fmt: skip
    ev.add({"cost_usd": 0.002, "usage": {"prompt_tokens": "10", "completion_tokens": 5},
            "output": {"sentiment": "negative"}}, "result")  # fmt: skip
    ev.add({"task_id": "t3", "error": {"category": "invalid_output"}, "usage": [1, 2],
            "cost_usd": True}, "dead_letter")  # fmt: skip
    ev.add({"task_id": "t4", "error": "refused"}, "dead_letter")  # no category: not judged
    e = ev.evaluation
    assert (e.judged, e.n("pass")) == (3, 2)
    assert e.cost_usd == pytest.approx(0.002)
    assert ev.cost.interval() is not None
    assert set(ev.outputs) == {"t1", "None"}


def test_a_decision_of_another_shape_is_logged_with_what_it_has() -> None:
    kept = {"at": "2026-12-07T10:00:00.000Z", "pipeline": "p", "version": "v2", "by": "ana",
            "reason": "better", "after": {"traffic": {"v1": 0.5, "v2": 0.5}}}  # fmt: skip
    assert decision_line(kept) == "2026-12-07T10:00:00.000Z p: v2 -> v1 0.5 / v2 0.5 by ana: better"
    # Once an AttributeError (a split that is a list) or a ValueError (a weight "half"):
    # `ab log` ended at the first such record.
    for after in ([["v1", 1]], {"traffic": ["v2"]}, {"traffic": {"v2": "half"}}, None):
        assert decision_line({**kept, "after": after, "forced": True}).endswith(
            "by ana (forced): better"
        )
