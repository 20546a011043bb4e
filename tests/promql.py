"""The subset of PromQL the drift alert rules use, evaluated on scraped samples, so a
test can say whether a rule of deploy/prometheus/rules.yml fires on a worker's series.

    expr   := clause ("and" clause)*
    clause := NAME ">" NUMBER | NAME ">" NUMBER "*" NAME

`A > c` keeps A's samples above c; `A > k * B` keeps those above k times the B sample
with the same labels (one-to-one matching); `X and Y` keeps X's samples whose labels
Y has. A rule fires when its expression keeps a sample.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

Sample = tuple[str, dict[str, str], float]
Vector = dict[frozenset[tuple[str, str]], float]

_CLAUSE = re.compile(
    r"^\s*([a-z_:][a-z0-9_:]*)\s*>\s*([0-9.]+)(?:\s*\*\s*([a-z_:][a-z0-9_:]*))?\s*$"
)


def _vector(samples: Iterable[Sample], name: str) -> Vector:
    return {frozenset(labels.items()): value for n, labels, value in samples if n == name}


def evaluate(expr: str, samples: Iterable[Sample]) -> Vector:
    samples = list(samples)
    result: Vector | None = None
    for clause in re.split(r"\s+and\s+", expr.strip()):
        m = _CLAUSE.match(clause)
        if m is None:
            raise ValueError(f"not in the supported subset: {clause!r}")
        left, number, right = m.group(1), float(m.group(2)), m.group(3)
        a = _vector(samples, left)
        if right is None:
            kept = {k: v for k, v in a.items() if v > number}
        else:
            b = _vector(samples, right)
            kept = {k: v for k, v in a.items() if k in b and v > number * b[k]}
        result = kept if result is None else {k: v for k, v in result.items() if k in kept}
    return result or {}


def firing(expr: str, samples: Iterable[Sample]) -> list[dict[str, str]]:
    """The label sets the expression keeps: what the alert fires for."""
    return [dict(k) for k in evaluate(expr, samples)]


__all__ = ["evaluate", "firing"]
