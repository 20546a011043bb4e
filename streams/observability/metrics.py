"""Prometheus series of one worker, all named `llm_streams_*`, in a registry of its own.

Labels stay bounded: lane, outcome, category, model, endpoint, pipeline, topic and
partition; never a task id. The worker serves them at `/metrics` on its web port, with
`llm_streams_build_info` (its version and its stack's) and the `process_*` series; no
`*_created` series (one per labelled counter, which nobody reads and every scrape pays).
"""

from __future__ import annotations

import importlib.metadata
import platform
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# LLM latencies: tens of milliseconds for a cached answer to minutes for a long one.
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 5000)


class _KeptChildren:
    """`labels()` without prometheus_client's work on every call (the values made
    strings, a lock, a lookup: ~3 µs, about twenty times per task): a label set's
    child is kept at its first use. The labels here are bounded (see above) and no
    child is ever removed, so what is kept is what the metric holds anyway."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._kept_children: dict[tuple[Any, ...], Any] = {}
        super().__init__(*args, **kwargs)

    def labels(self, *values: Any, **named: Any) -> Any:
        child = None if named else self._kept_children.get(values)
        if child is None:
            child = super().labels(*values, **named)  # type: ignore[misc]
            if not named:
                self._kept_children[values] = child
        return child


class Counter(_KeptChildren, prometheus_client.Counter):
    pass


class Gauge(_KeptChildren, prometheus_client.Gauge):
    pass


class Histogram(_KeptChildren, prometheus_client.Histogram):
    pass


BREAKER_STATES = {"closed": 0, "half_open": 1, "open": 2}
RECENT_DEAD_LETTERS = 20  # the status page's latest dead letters
MODEL_LABELS = 64  # model names an answer says with series of their own (`model_label`)


prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped in prometheus_client


def _versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for label, dist in (("version", "llm-streams"), ("faust", "faust-streaming"),
                        ("aiokafka", "aiokafka"), ("openai", "openai")):  # fmt: skip
        try:
            found[label] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[label] = "unknown"
    return found


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        prometheus_client.Info("llm_streams_build", "The worker's version and its stack's.",
                               registry=self.registry).info(_versions())  # fmt: skip
        prometheus_client.ProcessCollector(registry=self.registry)
        # The latest dead letters, newest last, for the status page (not a series: the
        # task id and message would be unbounded labels).
        self.recent_dead: deque[dict[str, Any]] = deque(maxlen=RECENT_DEAD_LETTERS)
        # When each breaker took its state (wall time), for the page's "open since". One
        # entry per endpoint or deployment, which the configuration bounds.
        self.breaker_since: dict[str, float] = {}
        self._models: set[str] = set()  # the answers' model names with series of their own
        r = self.registry
        self.tasks_received = Counter(
            "llm_streams_tasks_received", "Records taken from the input topics.", ["lane"],
            registry=r)  # fmt: skip
        self.tasks_completed = Counter(
            "llm_streams_tasks_completed", "Records finished (outcome written and acked).",
            ["lane", "outcome"], registry=r)  # fmt: skip
        self.dead_letters = Counter(
            "llm_streams_dead_letters", "Dead letters written, by error category.",
            ["category"], registry=r)  # fmt: skip
        self.state_loaded = Counter(
            "llm_streams_state_loaded_records",
            "Records read back into the task store when a partition was assigned, by map.",
            ["map"], registry=r)  # fmt: skip
        self.store_standbys = Gauge(
            "llm_streams_store_standby_partitions",
            "Task partitions this worker stands by for (store_standby_replicas): their "
            "stores followed on its disk.", registry=r)  # fmt: skip
        self.standby_records = Counter(
            "llm_streams_store_standby_records",
            "Records the worker's standbys read from the stores' topics (made durable).",
            registry=r)  # fmt: skip
        self.store_flush_errors = Counter(
            "llm_streams_store_flush_errors",
            "Times the task store could not write its local copy to disk (full?); the "
            "writes stay in memory until a flush succeeds.", registry=r)  # fmt: skip
        self.store_unflushed = Gauge(
            "llm_streams_store_unflushed_bytes",
            "Bytes of writes the task store holds in memory because its disk refused them, "
            "as of its last flush; past store_unflushed_mb, records wait.", registry=r)  # fmt: skip
        self.store_expired = Counter(
            "llm_streams_store_expired",
            "Task store entries deleted for being past their map's retention, by map.",
            ["map"], registry=r)  # fmt: skip
        self.store_entries = Gauge(
            "llm_streams_store_entries",
            "Entries the task store holds for this worker's partitions, by map.",
            ["map"], registry=r)  # fmt: skip
        self.store_unreadable = Counter(
            "llm_streams_store_unreadable_records",
            "Records of the worker's own topics it could not read while loading the task "
            "store (skipped), by map.", ["map"], registry=r)  # fmt: skip
        self.writes_refused = Counter(
            "llm_streams_writes_refused",
            "Writes the producer or broker refused for good (record_too_large, "
            "invalid_record, not_authorized), by topic: the task became a write_refused dead "
            "letter, or a review copy was left out.", ["topic", "reason"], registry=r)  # fmt: skip
        self.misrouted = Counter(
            "llm_streams_misrouted_records",
            "Task records not keyed by their task id: rerouted (forwarded to the partition "
            "their task id maps to) or answered (already on it).", ["lane", "action"],
            registry=r)  # fmt: skip
        self.source_records = Counter(
            "llm_streams_source_records",
            "Records of source topics (pipelines' `source:`): forwarded (as a task to "
            "llm-tasks), skipped (not for the pipeline: its filter, a tombstone), erased (a "
            "delete upstream: its task's answers erased) or dead_letter (could not be "
            "mapped).", ["pipeline", "outcome"],
            registry=r)  # fmt: skip
        self.erasures = Counter(
            "llm_streams_erasures",
            "Tasks whose answers were erased (results, dead letter, state, review and sink "
            "records): by a delete upstream (via=source) or by `llm-streams erase` "
            "(via=command); pipeline=unknown for a pipeline this worker does not know.",
            ["pipeline", "via"],
            registry=r)  # fmt: skip
        self.schema_lookups = Counter(
            "llm_streams_schema_lookups",
            "Schema registry lookups of source records' schema ids: cached, fetched, unknown "
            "(the registry has no such id: a dead letter) or unavailable (a failed request, "
            "tried again).", ["outcome"], registry=r)  # fmt: skip
        self.partitions_restarted = Counter(
            "llm_streams_partitions_restarted",
            "Partitions started again from their committed offsets while still this worker's: "
            "exactly-once's producer fenced (transaction timed out), or the local store found "
            "damaged.", registry=r)  # fmt: skip
        self.in_flight = Gauge(
            "llm_streams_tasks_in_flight", "Tasks being processed now.", registry=r)  # fmt: skip
        self.replay_idle = Gauge(
            "llm_streams_replay_partitions_idle",
            "Replay lane partitions read to their end and left out of the worker's fetches "
            "until records come (kafka.replay_idle_check_s).", registry=r)  # fmt: skip
        self.unfinished = Gauge(
            "llm_streams_tasks_unfinished",
            "Records taken from the stream and not yet acked (in flight or waiting for a slot).",
            registry=r)  # fmt: skip
        self.llm_requests = Counter(
            "llm_streams_llm_requests", "LLM attempts, by model, status (ok|error) and category.",
            ["model", "status", "category"], registry=r)  # fmt: skip
        self.llm_seconds = Histogram(
            "llm_streams_llm_call_seconds", "Duration of one LLM attempt.", ["model"],
            buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.limiter_wait = Histogram(
            "llm_streams_limiter_wait_seconds", "Wait for rate-limit capacity per attempt.",
            ["lane"], buckets=WAIT_BUCKETS, registry=r)  # fmt: skip
        self.taken_after = Histogram(
            "llm_streams_taken_after_seconds",
            "From the record's timestamp to the agent taking it (time in Kafka and in the "
            "fetch buffers).", ["lane"], buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.queue_wait = Histogram(
            "llm_streams_queue_wait_seconds", "From taken off the stream to processing start.",
            ["lane"], buckets=WAIT_BUCKETS, registry=r)  # fmt: skip
        self.end_to_end = Histogram(
            "llm_streams_end_to_end_seconds", "From the record's timestamp to its outcome acked.",
            ["lane", "outcome"], buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.tokens = Counter(
            "llm_streams_tokens",
            "Tokens used, by model and kind (prompt|completion|cached_prompt: prompt tokens the "
            "provider read from its cache, among the prompt's).",
            ["model", "kind"], registry=r)  # fmt: skip
        self.cost = Counter(
            "llm_streams_cost_usd",
            "Spend in USD from the price table, retries included, by price tier "
            "(sync, or batch/flex at the batch price).",
            ["pipeline", "model", "tier"], registry=r)  # fmt: skip
        self.budget_spent = Gauge(
            "llm_streams_budget_spent_usd",
            "This worker's spend in the current window of a pipeline's spend cap (lane: all, "
            "live, replay; window: hour, day).", ["pipeline", "lane", "window"],
            registry=r)  # fmt: skip
        self.budget_cap = Gauge(
            "llm_streams_budget_cap_usd",
            "This worker's share of a pipeline's spend cap (its part of the group's "
            "partitions).", ["pipeline", "lane", "window"], registry=r)  # fmt: skip
        self.budget_waiting = Gauge(
            "llm_streams_budget_waiting_tasks",
            "Tasks waiting at a pipeline's spend cap for its next window (unacked, not "
            "dead-lettered).", ["pipeline", "lane"], registry=r)  # fmt: skip
        self.budget_waits = Counter(
            "llm_streams_budget_waits",
            "Tasks that had to wait at a pipeline's spend cap.", ["pipeline", "lane"],
            registry=r)  # fmt: skip
        self.retries = Counter(
            "llm_streams_retries", "Attempts after a task's first, by the error that caused them.",
            ["category"], registry=r)  # fmt: skip
        self.outputs = Counter(
            "llm_streams_outputs", "Answers received, by content verdict (pass|fail).",
            ["model", "verdict"], registry=r)  # fmt: skip
        self.endpoint_concurrency = Gauge(
            "llm_streams_endpoint_concurrency",
            "Calls an endpoint takes at once, learned when it sends no rate limits (0: none "
            "learned: its rate limits it).", ["endpoint"], registry=r)  # fmt: skip
        self.endpoint_waiting = Gauge(
            "llm_streams_endpoint_waiting_calls",
            "Calls waiting for a turn at an endpoint's concurrency limit.",
            ["endpoint"], registry=r)  # fmt: skip
        self.discount_unconfirmed = Counter(
            "llm_streams_discount_unconfirmed",
            "Calls asked at a discounted tier (flex) whose answer did not confirm it: booked at "
            "the full price.",
            ["model", "tier"], registry=r)  # fmt: skip
        self.structured_degraded = Counter(
            "llm_streams_structured_output_degraded",
            "Answers whose endpoint did not honour the structured-output mode asked for, by "
            "mode and what came instead (a forced tool call answered as content; json_schema "
            "refused, then asked as schema_in_prompt).",
            ["model", "mode", "instead"], registry=r)  # fmt: skip
        self.batch_size = Histogram(
            "llm_streams_batch_size", "Records per micro-batch.", buckets=BATCH_BUCKETS,
            registry=r)  # fmt: skip
        self.batch_fill = Histogram(
            "llm_streams_batch_fill_seconds", "Time to fill one micro-batch.",
            buckets=WAIT_BUCKETS, registry=r)  # fmt: skip
        self.breaker_state = Gauge(
            "llm_streams_breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open.",
            ["endpoint"], registry=r)  # fmt: skip
        # The same state as a label (a state set: 1 for the state it is in, 0 for the
        # others), the convention alerts and panels read without knowing the numbers.
        self.breaker = Gauge(
            "llm_streams_breaker", "Circuit breaker: 1 for the state it is in, by state.",
            ["endpoint", "state"], registry=r)  # fmt: skip
        self.breaker_transitions = Counter(
            "llm_streams_breaker_transitions", "Breaker transitions, by endpoint and new state.",
            ["endpoint", "to"], registry=r)  # fmt: skip
        self.limiter_rate = Gauge(
            "llm_streams_limiter_rate_per_minute", "Current (learned) limiter rate.",
            ["model", "unit"], registry=r)  # fmt: skip
        self.limiter_throttled = Counter(
            "llm_streams_limiter_throttled", "429 answers that cut the limiter's rate.",
            ["model"], registry=r)  # fmt: skip
        # Per declared deployment (`llm.deployments`; "default": OPENAI_BASE_URL's): names
        # from the deployments file, so the labels stay few.
        self.deployment_models: dict[str, str] = {}  # deployment -> the model it serves
        self.deployment_calls = Counter(
            "llm_streams_deployment_calls",
            "Calls per deployment by outcome: ok, throttled (a 429), error.",
            ["deployment", "outcome"], registry=r)  # fmt: skip
        self.deployment_cost = Counter(
            "llm_streams_deployment_cost_usd",
            "Spend in USD per deployment, at its price (tier discounts included).",
            ["deployment"], registry=r)  # fmt: skip
        self.usage_unsaid = Counter(
            "llm_streams_usage_unsaid",
            "Answers that said no token usage (no usage block, or every count 0), by "
            "deployment: their tokens were counted locally with the offline tokenizer.",
            ["deployment"], registry=r)  # fmt: skip
        self.unanswered_tokens = Counter(
            "llm_streams_unanswered_prompt_tokens",
            "Prompt tokens of calls sent that got no answer (timed out, cut at the task's "
            "deadline, dropped or cancelled mid-way), by deployment: not in tokens_total or "
            "cost_usd_total; a server that finished them may bill them, and caps count them.",
            ["deployment"], registry=r)  # fmt: skip
        self.deployment_rate = Gauge(
            "llm_streams_deployment_rate_per_minute",
            "A deployment's current (learned) limiter rate.",
            ["deployment", "unit"], registry=r)  # fmt: skip
        self.mitigations = Counter(
            "llm_streams_mitigations",
            "What was done instead of the plain way: an input over the context window "
            "truncated (cut to fit) or chunked (split, each chunk answered, answers merged); "
            "a flex call with no capacity answered at the sync price (flex_fallback); a "
            "batch-tier record too large to park answered by a call (batch_unparkable); a "
            "parameter the model refused sent under the name it said (param_renamed) or "
            "left out (param_dropped), counted when learned.",
            ["pipeline", "kind"], registry=r)  # fmt: skip
        self.packed = Counter(
            "llm_streams_packed_tasks",
            "Tasks sent in a packed request: outcome=packed (answered there) or alone "
            "(missing or invalid in the pack's answer, or the pack failed: answered alone).",
            ["pipeline", "outcome"], registry=r)  # fmt: skip
        self.batches = Counter(
            "llm_streams_batches",
            "Batch API batches: submitted, and how they ended (completed, expired, "
            "cancelled, failed).", ["status"], registry=r)  # fmt: skip
        self.batch_requests = Counter(
            "llm_streams_batch_requests",
            "Batch-lane requests by answer: ok, error (the attempt failed), resubmitted "
            "(the batch gave none: expired, cancelled, over the enqueued-token limit).",
            ["outcome"], registry=r)  # fmt: skip
        self.chunks = Counter(
            "llm_streams_chunks", "Chunks that inputs over the token budget were split into.",
            ["pipeline"], registry=r)  # fmt: skip
        self.versions_chosen = Counter(
            "llm_streams_prompt_versions",
            "Tasks by the prompt version they got and how: pinned by the task, split "
            "(A/B traffic bucket) or default.", ["pipeline", "version", "chosen_by"],
            registry=r)  # fmt: skip
        self.reviews = Counter(
            "llm_streams_reviews", "Results also sent to the review topic, by reason.",
            ["pipeline", "reason"], registry=r)  # fmt: skip
        self.redactions = Counter(
            "llm_streams_pii_redactions", "Personal data replaced before prompts, by kind.",
            ["pipeline", "kind"], registry=r)  # fmt: skip
        # Per prompt version (bounded: the versions pipeline files declare), the figures
        # `ab report` computes from the topics, live: see `evaluated`.
        self.version_tasks = Counter(
            "llm_streams_version_tasks",
            "Tasks finished per prompt version, by content verdict: pass (the first answer "
            "passed the output checks), repaired (passed after a repair), cached (answered "
            "without a call), rejected (a dead letter invalid_output), failed (another dead "
            "letter).", ["pipeline", "version", "verdict"], registry=r)  # fmt: skip
        self.version_seconds = Histogram(
            "llm_streams_version_task_seconds",
            "Time to answer one task (taken to outcome built), per prompt version.",
            ["pipeline", "version"], buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.version_tokens = Counter(
            "llm_streams_version_tokens", "Tokens spent per prompt version, by kind.",
            ["pipeline", "version", "kind"], registry=r)  # fmt: skip
        self.version_cost = Counter(
            "llm_streams_version_cost_usd", "Spend in USD per prompt version (dead letters' too).",
            ["pipeline", "version"], registry=r)  # fmt: skip
        self.version_reviews = Counter(
            "llm_streams_version_reviews",
            "Results per prompt version also sent to the review topic.",
            ["pipeline", "version"], registry=r)  # fmt: skip
        self.cache_hits = Counter(
            "llm_streams_cache_hits",
            "Tasks answered without an LLM call: kind=result (the task was answered before) "
            "or content (an identical input of another task was).",
            ["pipeline", "kind"], registry=r)  # fmt: skip
        self.stale_answers = Counter(
            "llm_streams_stale_answers",
            "Stored answers handed out again that an earlier definition of the same prompt "
            "version made (the version edited in place since; Result.prompt_digest).",
            ["pipeline", "version"], registry=r)  # fmt: skip

    def model_label(self, model: str) -> str:
        """A model name an answer says, as a label: the provider names it (a snapshot, the
        model a router chose, a server's file path), so the first `MODEL_LABELS` names
        have series of their own and the rest share `other`; cut to 128 characters."""
        name = model[:128]
        if name in self._models:
            return name
        if len(self._models) < MODEL_LABELS:
            self._models.add(name)
            return name
        return "other"

    def used(self, model: str, prompt: int, completion: int, cached_prompt: int = 0) -> None:
        """One answer's tokens."""
        self.tokens.labels(model, "prompt").inc(prompt)
        self.tokens.labels(model, "completion").inc(completion)
        if cached_prompt:
            self.tokens.labels(model, "cached_prompt").inc(cached_prompt)

    def evaluated(
        self,
        pipeline: str,
        version: str,
        verdict: str,
        *,
        seconds: float,
        prompt_tokens: int,
        completion_tokens: int,
        cost_usd: float,
        reviewed: bool,
    ) -> None:
        """One task finished under `version` (see `core.outcome.verdict`)."""
        self.version_tasks.labels(pipeline, version, verdict).inc()
        self.version_seconds.labels(pipeline, version).observe(seconds)
        self.version_tokens.labels(pipeline, version, "prompt").inc(prompt_tokens)
        self.version_tokens.labels(pipeline, version, "completion").inc(completion_tokens)
        self.version_cost.labels(pipeline, version).inc(cost_usd)
        if reviewed:
            self.version_reviews.labels(pipeline, version).inc()

    def dead_letter_written(self, task_id: str | None, error: dict[str, Any]) -> None:
        """Counted by category, and kept among the latest with its reason."""
        self.dead_letters.labels(error.get("category", "")).inc()
        self.recent_dead.append({
            "at": time.time(), "task_id": task_id, "category": error.get("category"),
            "code": error.get("code"), "message": str(error.get("message", ""))[:300],
        })  # fmt: skip

    def breaker_changed(self, endpoint: str, new_state: str) -> None:
        self.breaker_state.labels(endpoint).set(BREAKER_STATES[new_state])
        for state in BREAKER_STATES:
            self.breaker.labels(endpoint, state).set(1 if state == new_state else 0)
        self.breaker_transitions.labels(endpoint, new_state).inc()
        self.breaker_since[endpoint] = time.time()

    def watch_endpoint(
        self, endpoint: str, limit: Callable[[], int | None], waiting: Callable[[], int]
    ) -> None:
        """An endpoint's learned concurrency (0: none, its rate limits it) and the calls
        waiting for a turn, at every scrape."""
        self.endpoint_concurrency.labels(endpoint).set_function(lambda: limit() or 0)
        self.endpoint_waiting.labels(endpoint).set_function(waiting)

    def watch_limiter(self, model: str, rates: Callable[[], tuple[float, float | None]]) -> None:
        """Report a limiter's current requests/tokens per minute at every scrape."""
        self.limiter_rate.labels(model, "requests").set_function(lambda: rates()[0])
        self.limiter_rate.labels(model, "tokens").set_function(lambda: rates()[1] or 0.0)

    def watch_deployment(
        self, name: str, model: str, rates: Callable[[], tuple[float, float | None]]
    ) -> None:
        """Report a deployment's limiter rates at every scrape; `model`: the one it serves
        (a deployment's open breaker leaves the model served while another's is not)."""
        self.deployment_models[name] = model
        self.deployment_rate.labels(name, "requests").set_function(lambda: rates()[0])
        self.deployment_rate.labels(name, "tokens").set_function(lambda: rates()[1] or 0.0)

    def watch_drift(self, read: Callable[[], list[Any]]) -> None:
        """Output-drift gauges read at scrape time (see `DriftCollector`)."""
        self.registry.register(DriftCollector(read))

    def watch_stream(self, read: Callable[[], dict[str, Any]]) -> None:
        """Consumer-side gauges read at scrape time (see `StreamCollector`)."""
        self.registry.register(StreamCollector(read))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StreamCollector(Collector):
    """Lag per partition, partitions paused for backpressure and the stream buffer.

    `read` returns {"lag": {(topic, partition): n}, "paused": n, "buffered": n}
    from the Faust consumer; it runs at scrape time only.
    """

    def __init__(self, read: Callable[[], dict[str, Any]]) -> None:
        self.read = read

    def describe(self) -> Iterable[Any]:
        return []  # values exist only once the consumer runs

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            state = self.read()
        except Exception:  # no consumer yet (starting, rebalancing): report nothing
            return
        lag = GaugeMetricFamily(
            "llm_streams_consumer_lag", "Records behind the partition's end (committed offset).",
            labels=["topic", "partition"])  # fmt: skip
        for (topic, partition), value in sorted(state.get("lag", {}).items()):
            lag.add_metric([topic, str(partition)], value)
        yield lag
        yield GaugeMetricFamily(
            "llm_streams_backpressure_paused_partitions",
            "Partitions whose fetching is paused because the stream buffer is full.",
            value=state.get("paused", 0))  # fmt: skip
        yield GaugeMetricFamily(
            "llm_streams_stream_buffered_records",
            "Records fetched into the stream buffer, not yet taken by the agent.",
            value=state.get("buffered", 0))  # fmt: skip


class DriftCollector(Collector):
    """Output drift per prompt version (`core.drift.DriftMonitor.rows`), at scrape time.

    Labels stay bounded: pipeline, version and field come from the pipeline files, value
    from a field's enum; `measure` is psi (labels) or ks (numbers)."""

    def __init__(self, read: Callable[[], list[Any]]) -> None:
        self.read = read

    def describe(self) -> Iterable[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        answers = GaugeMetricFamily(
            "llm_streams_drift_window_answers",
            "Answers in the worker's drift window, per prompt version.",
            labels=["pipeline", "version"])  # fmt: skip
        share = GaugeMetricFamily(
            "llm_streams_drift_share",
            "Share of each label value in the window (a list field: of the labels given).",
            labels=["pipeline", "version", "field", "value"])  # fmt: skip
        base_share = GaugeMetricFamily(
            "llm_streams_drift_baseline_share", "Share of each label value in the baseline.",
            labels=["pipeline", "version", "field", "value"])  # fmt: skip
        divergence = GaugeMetricFamily(
            "llm_streams_drift_divergence",
            "The window against the stored baseline: PSI for labels, the KS statistic for "
            "numbers (the answer's length too, field=(length)).",
            labels=["pipeline", "version", "field", "measure"])  # fmt: skip
        null = GaugeMetricFamily(
            "llm_streams_drift_null_ratio",
            "Share of answers leaving an optional field null or at its schema default.",
            labels=["pipeline", "version", "field"])  # fmt: skip
        base_null = GaugeMetricFamily(
            "llm_streams_drift_baseline_null_ratio",
            "The same share in the baseline.", labels=["pipeline", "version", "field"])  # fmt: skip
        for pipeline, version, n, fields in self.read():
            answers.add_metric([pipeline, version], n)
            for f in fields:
                at = [pipeline, version, f.field]
                for value, x in f.shares.items():
                    share.add_metric([*at, value], x)
                for value, x in f.baseline_shares.items():
                    base_share.add_metric([*at, value], x)
                if f.divergence is not None:
                    divergence.add_metric([*at, f.measure], f.divergence)
                if f.empty_ratio is not None:
                    null.add_metric(at, f.empty_ratio)
                if f.baseline_empty_ratio is not None:
                    base_null.add_metric(at, f.baseline_empty_ratio)
        yield from (answers, share, base_share, divergence, null, base_null)


__all__ = ["LATENCY_BUCKETS", "DriftCollector", "Metrics", "StreamCollector"]
