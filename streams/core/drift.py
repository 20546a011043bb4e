"""Output drift of a prompt version: what its answers look like over a sliding window,
against a baseline (an earlier window or another version, stored durably).

Per output field, as the pipeline's output schema types it:
- a label (string enum), or a list of labels: the share of each value (a list counts
  each label it holds, and `(none)` when empty); divergence = PSI, the population
  stability index (sum of (p - q) ln(p / q), shares floored at `EPSILON`);
- a number: the Kolmogorov-Smirnov statistic (largest gap of the two empirical CDFs);
- an optional field: the share of answers that leave it null or at its schema default.
Output length (characters of the answer as JSON) is a number field, `(length)`.

Plain data, no Kafka: the worker keeps a `DriftMonitor` fed by its results and
exported by `observability.metrics.DriftCollector`; `llm-streams drift` builds the same
`Profile`s from the results topic. PSI and KS take a few lines here: the project needs
no statistics library for them.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import orjson

EPSILON = 1e-4  # share floor for PSI: a value never seen does not make it infinite
NONE = "(none)"  # an empty list of labels
LENGTH = "(length)"  # the answer's length in characters of JSON
MAX_SAMPLES = 1000  # numbers kept per field in a stored profile (its record stays small)


@dataclass(frozen=True)
class FieldKind:
    name: str
    kind: str  # label | labels | number
    values: tuple[str, ...] = ()  # a label's enum
    optional: bool = False
    default: Any = None


def field_kinds(schema: dict[str, Any]) -> list[FieldKind]:
    """The fields drift is measured on, from an output schema's top-level properties."""
    required = set(schema.get("required", []))
    out = []
    for name, spec in schema.get("properties", {}).items():
        optional, default = name not in required, spec.get("default")
        types = spec.get("type")
        types = types if isinstance(types, list) else [types]
        items = spec.get("items") if isinstance(spec.get("items"), dict) else {}
        if "enum" in spec and "string" in types:
            values = tuple(str(v) for v in spec["enum"])
            out.append(FieldKind(name, "label", values, optional, default))
        elif "array" in types and "enum" in items:
            values = (*(str(v) for v in items["enum"]), NONE)
            out.append(FieldKind(name, "labels", values, optional, default))
        elif "number" in types or "integer" in types:
            out.append(FieldKind(name, "number", (), optional, default))
        elif optional:  # only its null/default share
            out.append(FieldKind(name, "other", (), optional, default))
    out.append(FieldKind(LENGTH, "number"))
    return out


@dataclass
class Features:
    """What one answer contributes: labels by field, numbers by field, fields left empty."""

    labels: dict[str, tuple[str, ...]]
    numbers: dict[str, float]
    empty: frozenset[str]


def features(output: dict[str, Any], kinds: list[FieldKind]) -> Features:
    labels: dict[str, tuple[str, ...]] = {}
    numbers: dict[str, float] = {}
    empty = set()
    for k in kinds:
        if k.name == LENGTH:
            numbers[LENGTH] = float(len(orjson.dumps(output)))
            continue
        value = output.get(k.name)
        if k.optional and (value is None or (k.default is not None and value == k.default)):
            empty.add(k.name)
        if k.kind == "label" and isinstance(value, str):
            labels[k.name] = (value,)
        elif k.kind == "labels" and isinstance(value, list):
            labels[k.name] = tuple(str(v) for v in value) or (NONE,)
        elif k.kind == "number" and isinstance(value, int | float) and not isinstance(value, bool):
            numbers[k.name] = float(value)
    return Features(labels, numbers, frozenset(empty))


@dataclass
class Profile:
    """The answers of one version over a window, summed up."""

    answers: int = 0
    counts: dict[str, Counter[str]] = field(default_factory=dict)  # label field -> value counts
    numbers: dict[str, list[float]] = field(default_factory=dict)  # number field -> samples
    empty: Counter[str] = field(default_factory=Counter)  # optional field -> answers empty

    def add(self, f: Features, sign: int = 1) -> None:
        self.answers += sign
        for name, values in f.labels.items():
            c = self.counts.setdefault(name, Counter())
            for v in values:
                c[v] += sign
        for name, x in f.numbers.items():
            samples = self.numbers.setdefault(name, [])
            if sign > 0:
                bisect.insort(samples, x)
            else:
                del samples[bisect.bisect_left(samples, x)]
        for name in f.empty:
            self.empty[name] += sign

    def shares(self, name: str, values: tuple[str, ...]) -> dict[str, float]:
        c = self.counts.get(name, Counter())
        total = sum(c[v] for v in values) or sum(c.values())
        return {v: (c[v] / total if total else 0.0) for v in values}

    def empty_ratio(self, name: str) -> float:
        return self.empty[name] / self.answers if self.answers else 0.0

    def to_json(self) -> dict[str, Any]:
        numbers = {}
        for name, xs in self.numbers.items():  # evenly spaced order statistics
            step = max(1, math.ceil(len(xs) / MAX_SAMPLES))
            numbers[name] = xs[::step]
        return {"answers": self.answers, "counts": {k: dict(v) for k, v in self.counts.items()},
                "numbers": numbers, "empty": dict(self.empty)}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Profile:
        counts, numbers = data.get("counts") or {}, data.get("numbers") or {}
        return cls(
            answers=int(data.get("answers", 0)),
            counts={k: Counter({str(a): int(b) for a, b in v.items()}) for k, v in counts.items()},
            numbers={k: sorted(float(x) for x in v) for k, v in numbers.items()},
            empty=Counter({k: int(v) for k, v in (data.get("empty") or {}).items()}),
        )


def psi(p: dict[str, float], q: dict[str, float]) -> float:
    """Population stability index of shares `p` (now) against `q` (baseline)."""
    total = 0.0
    for v in set(p) | set(q):
        a, b = max(p.get(v, 0.0), EPSILON), max(q.get(v, 0.0), EPSILON)
        total += (a - b) * math.log(a / b)
    return total


def ks(xs: list[float], ys: list[float]) -> float:
    """Two-sample Kolmogorov-Smirnov statistic of sorted samples."""
    if not xs or not ys:
        return 0.0
    gap = 0.0
    for v in sorted(set(xs) | set(ys)):
        fx = bisect.bisect_right(xs, v) / len(xs)
        fy = bisect.bisect_right(ys, v) / len(ys)
        gap = max(gap, abs(fx - fy))
    return gap


@dataclass(frozen=True)
class FieldDrift:
    """One field of a version, now against the baseline."""

    field: str
    kind: str
    measure: str | None  # psi | ks | None (only the empty share)
    divergence: float | None
    shares: dict[str, float]  # labels: each value's share now
    baseline_shares: dict[str, float]
    empty_ratio: float | None  # optional fields: null or default now
    baseline_empty_ratio: float | None


def compare(now: Profile, baseline: Profile | None, kinds: list[FieldKind]) -> list[FieldDrift]:
    """Each field's drift (divergences None without a baseline or without answers)."""
    out = []
    judged = baseline is not None and baseline.answers > 0 and now.answers > 0
    for k in kinds:
        measure, div = None, None
        shares = base_shares = {}
        if k.kind in ("label", "labels"):
            shares = now.shares(k.name, k.values)
            measure = "psi"
            if judged and baseline is not None:
                base_shares = baseline.shares(k.name, k.values)
                div = psi(shares, base_shares)
        elif k.kind == "number":
            measure = "ks"
            if judged and baseline is not None:
                div = ks(now.numbers.get(k.name, []), baseline.numbers.get(k.name, []))
        out.append(FieldDrift(
            k.name, k.kind, measure, div, shares, base_shares,
            now.empty_ratio(k.name) if k.optional else None,
            baseline.empty_ratio(k.name) if k.optional and judged and baseline else None,
        ))  # fmt: skip
    return out


class Window:
    """The last `size` answers of one version, summed up as they come and go."""

    def __init__(self, kinds: list[FieldKind], size: int) -> None:
        self.kinds = kinds
        self.profile = Profile()
        self._kept: deque[Features] = deque()
        self.size = size

    def add(self, output: dict[str, Any]) -> None:
        f = features(output, self.kinds)
        self._kept.append(f)
        self.profile.add(f)
        if len(self._kept) > self.size:
            self.profile.add(self._kept.popleft(), sign=-1)


class DriftMonitor:
    """A worker's windows per (pipeline, version) and the baselines they are held to.

    Bounded: one window per version the pipeline files declare, `size` answers each."""

    def __init__(self, schemas: dict[str, dict[str, Any]], size: int = 1000) -> None:
        self.kinds = {name: field_kinds(schema) for name, schema in schemas.items()}
        self.size = size
        self.windows: dict[tuple[str, str], Window] = {}
        self.baselines: dict[tuple[str, str], Profile] = {}

    def observe(self, pipeline: str, version: str, output: dict[str, Any]) -> None:
        kinds = self.kinds.get(pipeline)
        if kinds is None:
            return
        window = self.windows.get((pipeline, version))
        if window is None:
            window = self.windows[(pipeline, version)] = Window(kinds, self.size)
        window.add(output)

    def rows(self) -> list[tuple[str, str, int, list[FieldDrift]]]:
        """(pipeline, version, answers in the window, each field's drift), for export."""
        return [
            (p, v, w.profile.answers, compare(w.profile, self.baselines.get((p, v)), w.kinds))
            for (p, v), w in sorted(self.windows.items())
        ]


def baseline_key(pipeline: str, version: str) -> bytes:
    return f"{pipeline}/{version}".encode()


__all__ = [
    "DriftMonitor", "FieldDrift", "FieldKind", "Profile", "Window", "baseline_key", "compare",
    "features", "field_kinds", "ks", "psi",
]  # fmt: skip
