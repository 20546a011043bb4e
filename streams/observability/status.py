"""A worker's live status from its own metrics: JSON for `llm-streams status`, and a small
HTML page (`/status`, refreshing) with the same numbers.

Percentiles are estimated from the end-to-end histogram the way Prometheus'
`histogram_quantile` does (linear within a bucket), so the page, the terminal
view and a Grafana panel agree. Throughput is measured between the last calls
(up to a minute back), so the first look reports the average since start.
"""

from __future__ import annotations

import html
import time
from collections import defaultdict, deque
from typing import Any

from streams.contract.evaluation import Evaluation
from streams.observability.metrics import Metrics

QUANTILES = (0.5, 0.95, 0.99)
BREAKER_NAMES = {0: "closed", 1: "half_open", 2: "open"}


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """`buckets`: (upper bound, cumulative count) sorted, ending with +Inf."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if upper == float("inf"):
                return lower  # beyond the last finite bucket: its lower bound, as Prometheus
            width = count - below
            return lower + (upper - lower) * ((rank - below) / width if width else 1.0)
        lower, below = upper, count
    return lower


class StatusView:
    """Reads the registry of one worker into the figures an operator looks at first."""

    def __init__(self, metrics: Metrics, clock: Any = time.monotonic) -> None:
        self.metrics = metrics
        self.clock = clock
        self.started = clock()
        self._samples: deque[tuple[float, float]] = deque()

    def _samples_by_name(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        found: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
        for family in self.metrics.registry.collect():
            for s in family.samples:
                found[s.name].append((dict(s.labels), float(s.value)))
        return found

    def snapshot(self) -> dict[str, Any]:
        samples = self._samples_by_name()

        def total(name: str, **want: str) -> float:
            return sum(
                v
                for labels, v in samples.get(name, [])
                if all(labels.get(k) == x for k, x in want.items())
            )

        completed = total("llm_streams_tasks_completed_total")
        now = self.clock()
        self._samples.append((now, completed))
        while len(self._samples) > 1 and now - self._samples[0][0] > 60:
            self._samples.popleft()
        first_t, first_n = self._samples[0]
        if now - first_t >= 1:
            throughput = (completed - first_n) / (now - first_t)
        else:
            throughput = completed / max(now - self.started, 1e-9)
        buckets: dict[float, float] = defaultdict(float)
        for labels, value in samples.get("llm_streams_end_to_end_seconds_bucket", []):
            buckets[float(labels["le"])] += value
        ordered = sorted(buckets.items())
        results = total("llm_streams_tasks_completed_total", outcome="result")
        cost = total("llm_streams_cost_usd_total")
        dead: dict[str, float] = defaultdict(float)
        for labels, value in samples.get("llm_streams_dead_letters_total", []):
            dead[labels["category"]] += value
        return {
            "versions": self._versions(samples),
            "tasks": {
                "received": total("llm_streams_tasks_received_total"),
                "results": results,
                "dead_letters": total("llm_streams_tasks_completed_total", outcome="dead_letter"),
                "in_flight": total("llm_streams_tasks_in_flight"),
            },
            "throughput_per_s": round(throughput, 3),
            "lag": total("llm_streams_consumer_lag"),
            "paused_partitions": total("llm_streams_backpressure_paused_partitions"),
            "breakers": {
                labels["endpoint"]: BREAKER_NAMES.get(int(v), str(v))
                for labels, v in samples.get("llm_streams_breaker_state", [])
            },
            "limiter_rpm": {
                labels["model"]: v
                for labels, v in samples.get("llm_streams_limiter_rate_per_minute", [])
                if labels.get("unit") == "requests"
            },
            "end_to_end_s": {f"p{int(q * 100)}": histogram_quantile(q, ordered) for q in QUANTILES},
            "cost_usd": round(cost, 8),
            "cost_per_result_usd": round(cost / results, 8) if results else None,
            "dead_letters_by_category": dict(sorted(dead.items(), key=lambda kv: -kv[1])[:5]),
        }

    @staticmethod
    def _versions(samples: dict[str, list[tuple[dict[str, str], float]]]) -> list[dict[str, Any]]:
        """Per pipeline version: the figures of `Evaluation` and its task time percentiles."""
        evals: dict[tuple[str, str], Evaluation] = defaultdict(Evaluation)
        buckets: dict[tuple[str, str], dict[float, float]] = defaultdict(lambda: defaultdict(float))

        def key(labels: dict[str, str]) -> tuple[str, str]:
            return labels["pipeline"], labels["version"]

        for labels, value in samples.get("llm_streams_version_tasks_total", []):
            e = evals[key(labels)]
            e.verdicts[labels["verdict"]] = e.verdicts.get(labels["verdict"], 0) + int(value)
        for labels, value in samples.get("llm_streams_version_cost_usd_total", []):
            evals[key(labels)].cost_usd += value
        for labels, value in samples.get("llm_streams_version_tokens_total", []):
            evals[key(labels)].tokens += int(value)
        for labels, value in samples.get("llm_streams_version_reviews_total", []):
            evals[key(labels)].reviews += int(value)
        for labels, value in samples.get("llm_streams_version_task_seconds_bucket", []):
            buckets[key(labels)][float(labels["le"])] += value

        def share(x: float | None) -> float | None:
            return None if x is None else round(x, 4)

        out = []
        for (pipeline, version), e in sorted(evals.items()):
            ordered = sorted(buckets[(pipeline, version)].items())
            out.append({
                "pipeline": pipeline, "version": version, "tasks": e.tasks,
                "pass_rate": share(e.pass_rate), "repair_rate": share(e.repair_rate),
                "dead_letter_rate": share(e.dead_letter_rate),
                "review_share": share(e.review_share),
                "latency_s": {f"p{int(q * 100)}": histogram_quantile(q, ordered)
                              for q in (0.5, 0.95)},
                "tokens_per_accepted": None if e.tokens_per_accepted is None
                else round(e.tokens_per_accepted, 1),
                "cost_per_accepted_usd": None if e.cost_per_accepted is None
                else round(e.cost_per_accepted, 8),
            })  # fmt: skip
        return out


def render_html(snap: dict[str, Any], refresh_s: int = 5) -> str:
    """The snapshot as a page; each figure sits in an element with `data-metric`."""

    def row(label: str, key: str, value: Any) -> str:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        shown = "–" if value is None else (f"{value:.6g}" if isinstance(value, float) else value)
        cell = f'<td data-metric="{html.escape(key)}">{html.escape(str(shown))}</td>'
        return f"<tr><th>{html.escape(label)}</th>{cell}</tr>"

    t = snap["tasks"]
    rows = [
        row("tasks received", "received", t["received"]),
        row("results", "results", t["results"]),
        row("dead letters", "dead_letters", t["dead_letters"]),
        row("in flight", "in_flight", t["in_flight"]),
        row("throughput (tasks/s)", "throughput_per_s", snap["throughput_per_s"]),
        row("consumer lag", "lag", snap["lag"]),
        row("paused partitions", "paused_partitions", snap["paused_partitions"]),
        *(row(f"end-to-end {k} (s)", f"e2e_{k}", v) for k, v in snap["end_to_end_s"].items()),
        row("cost so far (USD)", "cost_usd", snap["cost_usd"]),
        row("cost per result (USD)", "cost_per_result_usd", snap["cost_per_result_usd"]),
        *(row(f"breaker {k}", f"breaker_{k}", v) for k, v in snap["breakers"].items()),
        *(row(f"limiter {k} (RPM)", f"limiter_{k}", v) for k, v in snap["limiter_rpm"].items()),
        *(
            row(f"dead letters: {k}", f"dlq_{k}", v)
            for k, v in snap["dead_letters_by_category"].items()
        ),
    ]
    versions = "".join(_version_row(v) for v in snap.get("versions", []))
    if versions:
        head = "".join(f"<th>{h}</th>" for h in VERSION_COLUMNS)
        versions = f"<h2>Prompt versions</h2><table><tr>{head}</tr>{versions}</table>"
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<meta http-equiv='refresh' content='{refresh_s}'><title>llm-streams status</title>"
        "<style>body{font:14px sans-serif;margin:2em}th{text-align:left;padding-right:2em}"
        "td{font-family:monospace}</style></head><body><h1>llm-streams worker</h1>"
        f"<table>{''.join(rows)}</table>{versions}</body></html>"
    )


VERSION_COLUMNS = ("pipeline", "version", "tasks", "pass rate", "repair rate", "dead letters",
                   "review", "p50 (s)", "p95 (s)", "tokens / answer", "USD / answer")  # fmt: skip


def _version_row(v: dict[str, Any]) -> str:
    def pct(x: float | None) -> str:
        return "–" if x is None else f"{x:.1%}"

    def num(x: float | None, fmt: str) -> str:
        return "–" if x is None else format(x, fmt)

    name = f"{v['pipeline']}/{v['version']}"
    cells = [
        ("", v["pipeline"]), ("", v["version"]), ("tasks", str(v["tasks"])),
        ("pass_rate", pct(v["pass_rate"])), ("repair_rate", pct(v["repair_rate"])),
        ("dead_letter_rate", pct(v["dead_letter_rate"])), ("review_share", pct(v["review_share"])),
        ("p50", num(v["latency_s"]["p50"], ".3f")), ("p95", num(v["latency_s"]["p95"], ".3f")),
        ("tokens_per_accepted", num(v["tokens_per_accepted"], ".0f")),
        ("cost_per_accepted_usd", num(v["cost_per_accepted_usd"], ".6f")),
    ]  # fmt: skip
    tds = "".join(
        f'<td data-metric="version:{html.escape(name)}:{k}">{html.escape(x)}</td>'
        if k
        else f"<td>{html.escape(x)}</td>"
        for k, x in cells
    )
    return f"<tr>{tds}</tr>"


__all__ = ["StatusView", "histogram_quantile", "render_html"]
