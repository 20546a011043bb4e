"""A/B decisions on prompt versions: compare the versions of a pipeline from what they
answered, and promote one with a guard and a durable record of who, when and why.

The evidence is the topics, not a worker's counters: every result and dead letter
of the pipeline (`scan`), the latest per task and version. They are read a partition
at a time (a task's results and dead letters all live in its task's partition), and
what is held between partitions is counts and sums, not tasks: a pipeline's year of
answers held every task's output and cost. A task's content
verdict and a version's figures are `core.outcome.verdict` and `Evaluation`, the
same rules `llm-streams status` applies live.

Intervals are 95%: Wilson's score interval for a rate, Newcombe's hybrid score
interval (method 10) for the difference of two rates, the delta method for a ratio
(cost per answered task). They are a few lines each, and the project needs no
statistics library for them.

Promotion writes the pipeline file's `traffic` (and `default_version` when the
version takes all of it) with ruamel.yaml, which keeps the file's comments and
order, after the new file validates; the decision goes first to the decisions topic
(`<app_id>-decisions`, never deleted), so no split changes without its record.
Workers take a new split when they start.
"""

from __future__ import annotations

import getpass
import io
import math
import os
import tempfile
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Any

import orjson
from ruamel.yaml import YAML

from streams.contract.evaluation import Evaluation, PromotionGuard, verdict
from streams.contract.records import field_number, json_object, now_iso
from streams.kafka import clients
from streams.kafka.clients import partitions_of
from streams.kafka.scan import scan
from streams.kafka.topics import decisions_topic, ensure_topics
from streams.ops.diff import summarise
from streams.ops.outcomes import latest_outcomes
from streams.pipelines.render import PipelineVersion
from streams.pipelines.specs import PipelineSpec
from streams.settings import Settings

Z95 = 1.959964


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a rate k/n ((0, 1) when n = 0)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def rate_difference(k1: int, n1: int, k2: int, n2: int) -> tuple[float, float, float]:
    """k1/n1 - k2/n2 and Newcombe's hybrid score interval of it."""
    p1, p2 = (k1 / n1 if n1 else 0.0), (k2 / n2 if n2 else 0.0)
    l1, u1 = wilson(k1, n1)
    l2, u2 = wilson(k2, n2)
    d = p1 - p2
    lo = d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2)
    hi = d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)
    return d, lo, hi


@dataclass
class Ratio:
    """sum(x) / sum(y) over the same units, with a delta-method interval, from running
    sums: what it holds does not grow with the units."""

    n: int = 0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    syy: float = 0.0

    def add(self, x: float, y: float) -> None:
        self.n += 1
        self.sx += x
        self.sy += y
        self.sxx += x * x
        self.sxy += x * y
        self.syy += y * y

    def interval(self) -> tuple[float, float, float] | None:
        n = self.n
        if n == 0 or self.sy == 0:
            return None
        my = self.sy / n
        r = self.sx / self.sy
        if n < 2:
            return r, r, r
        # sum((x - r y)^2) expanded; cancellation can take it a hair below 0
        var = max(0.0, self.sxx - 2 * r * self.sxy + r * r * self.syy) / (n - 1)
        half = Z95 * math.sqrt(var / n) / my
        return r, max(0.0, r - half), r + half


# What `VersionEvidence.add` reads of a record: the rest — a dead letter's payload, up to
# the topic's largest record — is not held while a pipeline's history is read.
_EVIDENCE = (
    "task_id",
    "cost_usd",
    "usage",
    "rejected_answers",
    "cached",
    "output",
    "prompt_digest",
)


def _evidence(record: dict[str, Any]) -> dict[str, Any]:
    kept = {name: record[name] for name in _EVIDENCE if name in record}
    error = record.get("error")
    if isinstance(error, dict):
        kept["error"] = {"category": error.get("category")}
    return kept


@dataclass
class VersionEvidence:
    """What one version answered: its verdicts, its cost per answered task, and its label
    agreement with the other versions on the tasks both answered."""

    version: str
    evaluation: Evaluation = field(default_factory=Evaluation)
    cost: Ratio = field(default_factory=Ratio)  # per task: its cost over 1 answered, else 0
    # The outputs of the tasks added since the last `agree` (one partition's): task id ->
    # output. Counted into `agreement` by it, then let go.
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    agreement: dict[str, dict[str, Agreement]] = field(default_factory=dict)  # other, label
    # Its results by the definition they were made under (`Result.prompt_digest`; results
    # older than the field are not counted): more than one, or another than the file's
    # now, and the figures are not those of the version as it is defined.
    definitions: dict[str, int] = field(default_factory=dict)

    def add(self, record: dict[str, Any], kind: str) -> None:
        """One task's latest outcome. Its figures read as 0 where they are not numbers
        (another version's shape, a hand-made record): one odd record does not stop the
        report."""
        cost = field_number(record.get("cost_usd"))
        usage = record.get("usage")
        usage = usage if isinstance(usage, dict) else {}
        tokens = int(field_number(usage.get("prompt_tokens"))
                     + field_number(usage.get("completion_tokens")))  # fmt: skip
        error = record.get("error")
        category = error.get("category") if isinstance(error, dict) else None
        v = verdict(kind, category, int(field_number(record.get("rejected_answers"))),
                    bool(record.get("cached")))  # fmt: skip
        self.evaluation.add(v, cost_usd=cost, tokens=tokens)
        self.cost.add(cost, 1.0 if kind == "result" else 0.0)
        if kind == "result" and isinstance(record.get("output"), dict):
            self.outputs[str(record.get("task_id"))] = record["output"]
        made = record.get("prompt_digest")
        if kind == "result" and isinstance(made, str):
            self.definitions[made] = self.definitions.get(made, 0) + 1

    def made_otherwise(self, now: PipelineVersion | None) -> int:
        """Its results made under another definition than `now`'s (the file's version)."""
        if now is None:
            return 0
        return sum(n for made, n in self.definitions.items() if now.made_otherwise(made))

    def pass_interval(self) -> tuple[float, float]:
        return wilson(self.evaluation.n("pass"), self.evaluation.judged)

    def cost_interval(self) -> tuple[float, float, float] | None:
        return self.cost.interval()


@dataclass
class Agreement:
    """How often two versions gave the same label on the tasks both answered."""

    label: str
    same: int = 0
    compared: int = 0

    def interval(self) -> tuple[float, float]:
        return wilson(self.same, self.compared)


def agree(evidence: dict[str, VersionEvidence], schema: dict[str, Any]) -> None:
    """The outputs added since the last call counted into each pair of versions' label
    agreement (per label field — string enum — of the output schema, over the tasks both
    answered), then let go."""
    for a, b in combinations(sorted(evidence.values(), key=lambda e: e.version), 2):
        both = sorted(set(a.outputs) & set(b.outputs))
        for d in summarise(((a.outputs[t], b.outputs[t]) for t in both), schema):
            if d.kind != "label" or not d.compared:
                continue
            for mine, other in ((a, b), (b, a)):
                counted = mine.agreement.setdefault(other.version, {}).setdefault(
                    d.name, Agreement(d.name)
                )
                counted.same += d.compared - d.changed
                counted.compared += d.compared
    for ev in evidence.values():
        ev.outputs.clear()


def agreements(a: VersionEvidence, b: VersionEvidence) -> list[Agreement]:
    """`a`'s label agreement with `b`, per label field, as `agree` counted it."""
    return sorted(a.agreement.get(b.version, {}).values(), key=lambda g: g.label)


async def gather(
    settings: Settings, pipeline: str, schema: dict[str, Any]
) -> dict[str, VersionEvidence]:
    """Per version, the latest outcome of each task of `pipeline`: its result if it has
    one (a redriven dead letter that was answered later counts as answered), else its
    latest dead letter; one task partition at a time, its agreements counted by `agree`
    before the next. A result or dead letter tombstoned since (erased, past the store's
    retention) is left out."""
    evidence: dict[str, VersionEvidence] = {}
    partitions: set[int] = set()
    for topic in (settings.topics.dead_letters, settings.topics.results):
        partitions.update(await partitions_of(settings, topic))
    for partition in sorted(partitions):
        # A task's result, when it has one, over its dead letter (a redriven one answered)
        latest: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {}
        for topic, kind in ((settings.topics.dead_letters, "dead_letter"),
                            (settings.topics.results, "result")):  # fmt: skip
            found = await latest_outcomes(settings, topic, partition, pipeline, _evidence)
            latest.update((at, (kind, record)) for at, record in found.items())
        for (version, _), (kind, record) in sorted(latest.items()):
            evidence.setdefault(version, VersionEvidence(version)).add(record, kind)
        agree(evidence, schema)
    return evidence


@dataclass
class Comparison:
    """`version` against `other`: the difference of their pass rates with its interval."""

    version: str
    other: str
    difference: float
    low: float
    high: float

    @property
    def significantly_worse(self) -> bool:
        return self.high < 0

    @property
    def significantly_better(self) -> bool:
        return self.low > 0


def compare(evidence: dict[str, VersionEvidence], version: str) -> list[Comparison]:
    """`version`'s pass rate against every other version's that has judged tasks."""
    mine = evidence[version].evaluation
    out = []
    for other, ev in sorted(evidence.items()):
        theirs = ev.evaluation
        if other == version or not theirs.judged or not mine.judged:
            continue
        d, lo, hi = rate_difference(mine.n("pass"), mine.judged, theirs.n("pass"), theirs.judged)
        out.append(Comparison(version, other, d, lo, hi))
    return out


def report(
    evidence: dict[str, VersionEvidence], now: dict[str, PipelineVersion] | None = None
) -> dict[str, Any]:
    """The comparison as data (`ab report --json`). `now`: the pipeline file's versions,
    whose definitions (`PipelineVersion.digest`) their results are counted against."""
    now = now or {}
    versions = []
    for name, ev in sorted(evidence.items()):
        e = ev.evaluation
        cost = ev.cost_interval()
        defined = now.get(name)
        versions.append({
            "definition": defined.digest if defined is not None else None,
            "results_by_definition": dict(ev.definitions),
            "results_made_otherwise": ev.made_otherwise(now.get(name)),
            "version": name, "tasks": e.tasks, "judged": e.judged, "accepted": e.accepted,
            "verdicts": dict(sorted(e.verdicts.items())),
            "pass_rate": e.pass_rate, "pass_rate_ci": list(ev.pass_interval()),
            "repair_rate": e.repair_rate, "dead_letter_rate": e.dead_letter_rate,
            "cost_per_accepted_usd": None if cost is None else cost[0],
            "cost_per_accepted_ci": None if cost is None else [cost[1], cost[2]],
        })  # fmt: skip
    names = sorted(evidence)
    pairs = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            diff = compare({a: evidence[a], b: evidence[b]}, a)
            pairs.append({
                "versions": [a, b],
                "pass_rate_difference": None if not diff else
                {"value": diff[0].difference, "ci": [diff[0].low, diff[0].high]},
                "agreement": [
                    {"label": g.label, "same": g.same, "compared": g.compared,
                     "rate": g.same / g.compared, "ci": list(g.interval())}
                    for g in agreements(evidence[a], evidence[b])
                ],
            })  # fmt: skip
    return {"versions": versions, "pairs": pairs}


DEFAULT_GUARD = PromotionGuard()


class PromotionRefused(Exception):
    """The guard said no: the message says why."""


def guard(evidence: dict[str, VersionEvidence], version: str, rivals: list[str],
          rules: PromotionGuard = DEFAULT_GUARD,
          now: PipelineVersion | None = None) -> None:  # fmt: skip
    """Refuse `version` unless it passes `rules` against every rival (the versions now in
    the split, or the default). Few judged tasks make wide intervals that show nothing
    significant, so a minimum comes first. `now`: the version as the file defines it;
    refused when some of its results were made under another (edited in place since, or
    during the test): its figures are not those of what would be promoted."""
    ev = evidence.get(version)
    if ev is None or not ev.evaluation.judged:
        raise PromotionRefused(f"{version} has no answered tasks to judge it by")
    otherwise = ev.made_otherwise(now)
    if otherwise:
        raise PromotionRefused(
            f"{otherwise} of {version}'s {sum(ev.definitions.values())} results were made "
            f"under another definition than the file's now ({now and now.digest}): it was "
            "edited in place, "
            "so its figures are not those of the version you would promote; answer its "
            "tasks again (`llm-streams replay --force`), or name the edit as a new version "
            "and test that"
        )
    if ev.evaluation.judged < rules.min_judged:
        raise PromotionRefused(
            f"{version} has {ev.evaluation.judged} judged task(s), "
            f"fewer than the {rules.min_judged} needed to judge it"
        )
    for c in compare({v: e for v, e in evidence.items() if v in rivals or v == version},
                     version):  # fmt: skip
        if c.significantly_worse:
            raise PromotionRefused(
                f"{version}'s pass rate is significantly worse than {c.other}'s: "
                f"{c.difference:+.1%} (95% CI {c.low:+.1%} to {c.high:+.1%})"
            )
    mine = ev.cost_interval()
    if mine is None or math.isinf(rules.max_cost_increase):
        return
    for rival in rivals:
        theirs = evidence[rival].cost_interval() if rival in evidence else None
        # An unpriced rival (cost 0) says nothing about what more is too much.
        if theirs is None or theirs[0] <= 0:
            continue
        if mine[1] > theirs[2] * (1.0 + rules.max_cost_increase):
            raise PromotionRefused(
                f"{version} costs significantly more per answered task than {rival}: "
                f"${mine[0]:.6f} (95% CI ${mine[1]:.6f} to ${mine[2]:.6f}) against "
                f"${theirs[0]:.6f} (up to ${theirs[2]:.6f}), over the "
                f"{rules.max_cost_increase:.0%} allowed"
            )


def pipeline_file(directory: Path, pipeline: str) -> Path:
    """The pipeline file that defines `pipeline`."""
    yaml = YAML(typ="safe")
    for path in sorted(directory.glob("*.y*ml")):
        data = yaml.load(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and data.get("name") == pipeline:
            return path
    raise FileNotFoundError(f"no pipeline file in {directory} defines {pipeline!r}")


def new_split(
    traffic: dict[str, float] | None, default: str, version: str, share: float
) -> dict[str, float]:
    """`version` gets `share` of the traffic; the others keep their proportions of the
    rest (no split before: the default version had it all)."""
    others = {v: w for v, w in (traffic or {default: 1.0}).items() if v != version and w > 0}
    total = sum(others.values())
    split = {version: round(share, 6)}
    if share < 1 and total > 0:
        split.update({v: round((1 - share) * w / total, 6) for v, w in sorted(others.items())})
    return split


def rewrite(
    path: Path, version: str, share: float, *, write: bool = True
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The pipeline file with `version` at `share` of the traffic (and the default when
    it takes all), comments kept; checked as a pipeline before it replaces the file
    (`write=False`: only checked). Returns the split and default before and after."""
    yaml = YAML()  # round trip: comments, order and quoting kept
    yaml.preserve_quotes = True
    yaml.width = 4096
    text = path.read_text(encoding="utf-8")
    data = yaml.load(text)
    # Plain values (ruamel's keep their formatting), for the decision's record.
    traffic = {str(v): float(w) for v, w in (data.get("traffic") or {}).items()}
    default = str(data["default_version"])
    before: dict[str, Any] = {"traffic": traffic or None, "default_version": default}
    split = new_split(traffic or None, default, version, share)
    data["traffic"] = split
    if share >= 1:
        data["default_version"] = version
    PipelineSpec.model_validate(YAML(typ="safe").load(_dump(yaml, data)))
    after = {"traffic": split, "default_version": str(data["default_version"])}
    if not write:
        return before, after
    with tempfile.NamedTemporaryFile(
        "w", delete=False, dir=path.parent, suffix=".tmp", encoding="utf-8"
    ) as tmp:
        yaml.dump(data, tmp)
    os.replace(tmp.name, path)  # atomic: a reader sees the old file or the new one
    return before, after


def _dump(yaml: YAML, data: Any) -> str:
    out = io.StringIO()
    yaml.dump(data, out)
    return out.getvalue()


async def record_decision(settings: Settings, decision: dict[str, Any]) -> None:
    """The decision, durably on the decisions topic (acks=all), keyed by pipeline."""
    topic = decisions_topic(settings)
    await ensure_topics(settings, [topic])
    producer = clients.producer(settings, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(topic, orjson.dumps(decision),
                                     key=str(decision["pipeline"]).encode())  # fmt: skip
    finally:
        await producer.stop()


async def decisions(settings: Settings, pipeline: str | None = None) -> list[dict[str, Any]]:
    """Decisions recorded so far (of one pipeline), oldest first."""
    found: list[dict[str, Any]] = []
    async for records in scan(settings, decisions_topic(settings)):
        for rec in records:
            d = json_object(rec.value) if rec.value is not None else None
            if d is not None and (pipeline is None or d.get("pipeline") == pipeline):
                found.append(d)
    return sorted(found, key=lambda d: str(d.get("at")))


def decision_line(d: dict[str, Any]) -> str:
    """One recorded decision as `ab log` prints it; the fields another version wrote in
    another shape (a split that is no object, a weight that is no number) read as
    absent, so one such record does not end the log."""
    after = d.get("after")
    traffic = after.get("traffic") if isinstance(after, dict) else None
    split = " / ".join(
        f"{v} {w:g}" if isinstance(w, int | float) and not isinstance(w, bool) else str(v)
        for v, w in (traffic.items() if isinstance(traffic, dict) else ())
    )
    forced = " (forced)" if d.get("forced") else ""
    return (f"{d.get('at')} {d.get('pipeline')}: {d.get('version')} -> {split} by "
            f"{d.get('by')}{forced}: {d.get('reason')}")  # fmt: skip


def decision(
    pipeline: str,
    version: str,
    share: float,
    reason: str,
    evidence: dict[str, VersionEvidence],
    *,
    by: str | None,
    forced: bool,
    before: dict[str, Any],
    after: dict[str, Any],
    rules: PromotionGuard = DEFAULT_GUARD,
    definition: str | None = None,
) -> dict[str, Any]:
    """The record of a promotion: who, when, why, the split before and after, the guard
    it was checked against and the evidence it was taken on; `definition`: the promoted
    version's as the file defines it (`PipelineVersion.digest`)."""
    return {
        "pipeline": pipeline, "version": version, "share": share, "reason": reason,
        "prompt_digest": definition,
        "by": by or getpass.getuser(), "at": now_iso(), "forced": forced,
        "before": before, "after": after, "guard": rules.as_record(),
        "evidence": {
            v: {"judged": ev.evaluation.judged, "pass_rate": ev.evaluation.pass_rate,
                "pass_rate_ci": list(ev.pass_interval()),
                "cost_per_accepted_usd": ev.evaluation.cost_per_accepted,
                "cost_per_accepted_ci": None if (c := ev.cost_interval()) is None
                else [c[1], c[2]]}
            for v, ev in sorted(evidence.items())
        },
    }  # fmt: skip


def rivals_of(spec: PipelineSpec, version: str) -> list[str]:
    """The versions `version` would take traffic from: those in the split, or the default."""
    split = {v for v, w in (spec.traffic or {}).items() if w > 0} or {spec.default_version}
    return sorted(split - {version})


__all__ = [
    "Agreement", "Comparison", "PromotionRefused", "Ratio", "VersionEvidence", "agree",
    "agreements", "compare", "decision", "decision_line", "decisions", "gather", "guard",
    "new_split", "pipeline_file", "rate_difference", "record_decision", "report", "rewrite",
    "rivals_of", "wilson",
]  # fmt: skip
