"""A worker's live status from its own metrics: JSON for `llm-streams status` and the
figures of its page (`observability.page`), with the last hour's history.

Percentiles are estimated from the end-to-end histogram the way Prometheus'
`histogram_quantile` does (linear within a bucket), so the page, the terminal
view and a Grafana panel agree. Throughput is measured between the last calls
(up to a minute back), so the first look reports the average since start.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable
from itertools import pairwise
from typing import Any

from streams.contract.evaluation import Evaluation
from streams.observability.metrics import BREAKER_STATES, Metrics

QUANTILES = (0.5, 0.95, 0.99)
HISTORY_S = 3600  # the page's charts: the last hour
SAMPLE_EVERY_S = 10.0  # one history point per this (the app's timer calls `sample`)
BREAKER_NAMES = {number: name for name, number in BREAKER_STATES.items()}


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

    def __init__(
        self, metrics: Metrics, clock: Any = time.monotonic,
        identity: Callable[[], dict[str, Any]] | None = None,
    ) -> None:  # fmt: skip
        """`identity`: what the worker is (host, group, model, endpoints, partitions), asked
        at each snapshot."""
        self.metrics = metrics
        self.clock = clock
        self.identity = identity or dict
        self.started = clock()
        self.started_at = time.time()
        self._samples: deque[tuple[float, float]] = deque()
        # (time, tasks completed, end-to-end buckets, cost, lag): cumulative, one per
        # SAMPLE_EVERY_S; the charts plot what changed between two of them.
        self.history: deque[tuple[float, float, dict[float, float], float, float]] = deque(
            maxlen=int(HISTORY_S / SAMPLE_EVERY_S) + 1
        )

    def uptime_s(self) -> float:
        return float(self.clock() - self.started)

    def _samples_by_name(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        found: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
        for family in self.metrics.registry.collect():
            for s in family.samples:
                found[s.name].append((dict(s.labels), float(s.value)))
        return found

    def sample(self) -> None:
        """One history point (the worker's timer calls this every SAMPLE_EVERY_S)."""
        samples = self._samples_by_name()
        self.history.append((
            self.clock(),
            _total(samples, "llm_streams_tasks_completed_total"),
            _buckets(samples, "llm_streams_end_to_end_seconds_bucket"),
            _total(samples, "llm_streams_cost_usd_total"),
            _total(samples, "llm_streams_consumer_lag"),
        ))  # fmt: skip

    def _history(self) -> list[dict[str, Any]]:
        """Per interval between history points: seconds ago, throughput, end-to-end p50
        and p95 of the tasks finished in it, USD per minute, lag at its end."""
        now = self.clock()
        out = []
        for (t0, n0, b0, c0, _), (t1, n1, b1, c1, lag) in pairwise(self.history):
            dt = max(t1 - t0, 1e-9)
            delta = sorted((le, b1.get(le, 0.0) - b0.get(le, 0.0)) for le in b1)
            out.append({
                "ago_s": round(now - t1, 1), "throughput_per_s": round((n1 - n0) / dt, 3),
                "e2e_p50_s": histogram_quantile(0.5, delta),
                "e2e_p95_s": histogram_quantile(0.95, delta),
                "cost_per_min_usd": round((c1 - c0) / dt * 60, 8), "lag": lag,
            })  # fmt: skip
        return out

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
            window = now - first_t
        else:
            window = max(now - self.started, 1e-9)
            throughput = completed / window
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
            "history": self._history(),
            "recent_dead_letters": list(reversed(self.metrics.recent_dead)),
            "versions": self._versions(samples),
            "tasks": {
                "received": total("llm_streams_tasks_received_total"),
                "results": results,
                "dead_letters": total("llm_streams_tasks_completed_total", outcome="dead_letter"),
                "in_flight": total("llm_streams_tasks_in_flight"),
            },
            "throughput_per_s": round(throughput, 3),
            "throughput_window_s": round(window, 1),
            "worker": self._worker(samples),
            "llm": _llm(samples),
            "lanes": _lanes(samples),
            "breaker_since": dict(self.metrics.breaker_since),
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
            "budgets": self._budgets(samples),
            "deployments": self._deployments(samples),
        }

    def _worker(self, samples: dict[str, list[tuple[dict[str, str], float]]]) -> dict[str, Any]:
        build = next(iter(samples.get("llm_streams_build_info", [])), ({}, 0.0))[0]
        return {**self.identity(), "version": build.get("version", "unknown"),
                "started_at": round(self.started_at, 3),
                "uptime_s": round(self.uptime_s(), 1)}  # fmt: skip

    @staticmethod
    def _deployments(
        samples: dict[str, list[tuple[dict[str, str], float]]],
    ) -> list[dict[str, Any]]:
        """Per declared deployment: its learned limits, its calls by outcome, its breaker
        and its spend (none without a deployments file)."""
        rates: dict[str, dict[str, float]] = defaultdict(dict)
        for ls, v in samples.get("llm_streams_deployment_rate_per_minute", []):
            rates[ls["deployment"]][ls["unit"]] = v
        calls: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for ls, v in samples.get("llm_streams_deployment_calls_total", []):
            calls[ls["deployment"]][ls["outcome"]] += v
        cost = {ls["deployment"]: v
                for ls, v in samples.get("llm_streams_deployment_cost_usd_total", [])}  # fmt: skip
        breakers = {ls["endpoint"]: BREAKER_NAMES.get(int(v), str(v))
                    for ls, v in samples.get("llm_streams_breaker_state", [])}  # fmt: skip
        return [
            {"deployment": name, "rpm": round(r.get("requests", 0.0), 1),
             "tpm": round(r["tokens"], 1) if r.get("tokens") else None,
             "ok": int(calls[name]["ok"]), "throttled": int(calls[name]["throttled"]),
             "errors": int(calls[name]["error"]), "breaker": breakers.get(name, "closed"),
             "cost_usd": round(cost.get(name, 0.0), 8)}
            for name, r in sorted(rates.items())
        ]  # fmt: skip

    @staticmethod
    def _budgets(samples: dict[str, list[tuple[dict[str, str], float]]]) -> list[dict[str, Any]]:
        """Per pipeline cap (lane, window): this worker's spend in the window, its share of
        the cap, and the pipeline's tasks of that lane waiting at a cap."""
        caps = {(ls["pipeline"], ls["lane"], ls["window"]): v
                for ls, v in samples.get("llm_streams_budget_cap_usd", [])}  # fmt: skip
        spent = {(ls["pipeline"], ls["lane"], ls["window"]): v
                 for ls, v in samples.get("llm_streams_budget_spent_usd", [])}  # fmt: skip
        waiting: dict[tuple[str, str], float] = defaultdict(float)
        for ls, v in samples.get("llm_streams_budget_waiting_tasks", []):
            waiting[(ls["pipeline"], ls["lane"])] += v
            waiting[(ls["pipeline"], "all")] += v
        return [
            {"pipeline": p, "lane": lane, "window": window, "cap_usd": round(cap, 6),
             "spent_usd": round(spent.get((p, lane, window), 0.0), 6),
             "waiting": int(waiting.get((p, lane), 0))}
            for (p, lane, window), cap in sorted(caps.items())
        ]  # fmt: skip

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

        drift = _worst_drift(samples)

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
                "drift": None if (pipeline, version) not in drift else
                {"divergence": round(drift[(pipeline, version)][0], 4),
                 "field": drift[(pipeline, version)][1]},
            })  # fmt: skip
        return out


def _worst_drift(
    samples: dict[str, list[tuple[dict[str, str], float]]],
) -> dict[tuple[str, str], tuple[float, str]]:
    """Per (pipeline, version): its largest divergence and which field and measure."""
    worst: dict[tuple[str, str], tuple[float, str]] = {}
    for labels, value in samples.get("llm_streams_drift_divergence", []):
        k = (labels["pipeline"], labels["version"])
        if value > worst.get(k, (-1.0, ""))[0]:
            worst[k] = (value, f"{labels['field']} {labels['measure']}")
    return worst


def _llm(samples: dict[str, list[tuple[dict[str, str], float]]]) -> dict[str, Any]:
    """LLM attempts since start: answered, refused for rate (429), failed by category, and
    the retries by the error that caused them."""
    errors: dict[str, float] = defaultdict(float)
    ok = 0.0
    for labels, value in samples.get("llm_streams_llm_requests_total", []):
        if labels.get("status") == "ok":
            ok += value
        else:
            errors[labels.get("category") or "unknown"] += value
    retries: dict[str, float] = defaultdict(float)
    for labels, value in samples.get("llm_streams_retries_total", []):
        retries[labels.get("category") or "unknown"] += value

    def most_first(counts: dict[str, float]) -> dict[str, int]:
        return {k: int(v) for k, v in sorted(counts.items(), key=lambda kv: -kv[1]) if v}

    return {"ok": int(ok), "rate_limited": int(errors.get("rate_limited", 0)),
            "errors": most_first(errors), "retries": most_first(retries)}  # fmt: skip


def _lanes(samples: dict[str, list[tuple[dict[str, str], float]]]) -> list[dict[str, Any]]:
    """Per lane (live, replay, ...) since start: tasks received, results, dead letters,
    and the end-to-end p95 of its results."""
    rows: dict[str, dict[str, Any]] = defaultdict(lambda: {"received": 0, "results": 0,
                                                             "dead_letters": 0})  # fmt: skip
    for labels, value in samples.get("llm_streams_tasks_received_total", []):
        rows[labels["lane"]]["received"] += int(value)
    for labels, value in samples.get("llm_streams_tasks_completed_total", []):
        outcome = {"result": "results", "dead_letter": "dead_letters"}.get(labels["outcome"])
        if outcome:
            rows[labels["lane"]][outcome] += int(value)
    buckets: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    for labels, value in samples.get("llm_streams_end_to_end_seconds_bucket", []):
        if labels.get("outcome") == "result":
            buckets[labels["lane"]][float(labels["le"])] += value
    return [{"lane": lane, **row,
             "e2e_p95_s": histogram_quantile(0.95, sorted(buckets[lane].items()))}
            for lane, row in sorted(rows.items())]  # fmt: skip


def _total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    return sum(v for _, v in samples.get(name, []))


def _buckets(
    samples: dict[str, list[tuple[dict[str, str], float]]], name: str
) -> dict[float, float]:
    out: dict[float, float] = defaultdict(float)
    for labels, value in samples.get(name, []):
        out[float(labels["le"])] += value
    return dict(out)


__all__ = ["HISTORY_S", "SAMPLE_EVERY_S", "StatusView", "histogram_quantile"]
