"""What one record ends as, built once as plain data: the outcome the edge writes.

A result or a dead letter, serialised here and nowhere else (the edge never
parses it again), sized to fit its topic (`ValueLimits`): a result too large
becomes a dead letter `output_too_large`, a dead letter keeps a head of a large
payload. Its cost is `core.spend`'s, priced by one rule for every tier.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal, cast

import orjson

from streams.contract.evaluation import verdict
from streams.contract.records import (
    DeadLetter,
    Result,
    Source,
    Task,
    Usage,
    ValueLimits,
    dead_letter_value,
    error_info,
    now_iso,
    payload_of,
    task_id_hint,
)
from streams.core.sessions import NONE as NO_CONTEXT
from streams.core.sessions import Context, add_turn, turn_of
from streams.core.sinks import SinkRecord, dead_letter_record, result_record
from streams.core.spend import Prices, Spend
from streams.core.stages import MAIN
from streams.errors import OutputTooLarge, StreamsError
from streams.llm.deployments import DEFAULT
from streams.observability.metrics import Metrics
from streams.observability.tracing import current_trace_id
from streams.pipelines.pipeline import Pipeline
from streams.pipelines.render import PipelineVersion, RenderedPrompt
from streams.pipelines.sinks import SinkSpec
from streams.resilience.retry import Attempts


@dataclass(frozen=True)
class Prepared:
    """A decoded, rendered task: what answering it needs, and its keys."""

    task: Task
    pipeline: Pipeline
    version: PipelineVersion
    prompt: RenderedPrompt
    result_key: str
    content_key: str
    raw: bytes | None
    key: bytes | None
    source: Source
    started: float
    # A task of a session: its id, where it stands in it, and the earlier turns its
    # prompt carries (`core.sessions`).
    session: str | None = None
    position: int = 0
    context: Context = NO_CONTEXT
    # The record as the edge runs it again, packed when a batch-tier job parks
    # (`core.batch.parking`); None (tests, tools): such a job waits for its batch.
    record: Callable[[], bytes] | None = None
    # A task forwarded from a source record: that record (`topic/partition/offset`, the
    # `llm-streams-source-of` header), the same however often it was forwarded.
    origin: str | None = None
    # A record a replay or a backtrack sent: `<its id>@<the record it copied>` (its
    # `llm-streams-replay-id` and `llm-streams-replay-of` headers), the same in every copy.
    run: str | None = None

    def session_turns(
        self, stored: bytes | None, output: dict[str, Any], max_bytes: int = 1_000_000
    ) -> bytes | None:
        """Its session's turns (`stored`) with this task's answer `output` in, within
        `max_bytes`; None when the task is no turn of a version that keeps sessions."""
        spec = self.version.spec.session
        if self.session is None or spec is None:
            return None
        turn = turn_of(self.task.task_id, self.position, self.prompt.variables, output, spec)
        return add_turn(stored, turn, spec, max_bytes)


@dataclass(frozen=True)
class Outcome:
    """What to write for one input record."""

    kind: Literal["result", "dead_letter"]
    key: str
    value: bytes
    task_id: str | None
    category: str | None = None
    error: dict[str, Any] | None = None  # a dead letter's error, as written
    latency_ms: float = 0.0
    attempts: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    unanswered_tokens: int = 0  # prompt tokens of calls sent that got no answer
    output: dict[str, Any] | None = None
    model: str | None = None
    # Multi-stage pipelines: every answer known so far by stage name (kept in the task
    # state, so a re-run resumes from the stage that failed), and where it ended.
    stages: dict[str, Any] | None = None
    stage: str = MAIN
    review: tuple[str, ...] = ()  # reasons this result also goes to the review topic
    review_value: bytes | None = None  # the result with those reasons, for that topic
    # For the per-version evaluation (`Metrics.evaluated`): whose task, how it went.
    pipeline: str | None = None
    version: str | None = None
    rejected: int = 0  # answers the output checks rejected
    cached: bool = False
    # The pipeline's sink record of it (`core.sinks`): its result again, or a copy of its
    # dead letter; written after the outcome, before the task's state.
    sink: SinkRecord | None = None

    @property
    def verdict(self) -> str:
        return verdict(self.kind, self.category, self.rejected, self.cached)

    def record(self) -> dict[str, Any]:
        """The result or dead letter, as written (record contract v1)."""
        return cast(dict[str, Any], orjson.loads(self.value))


class Outcomes:
    """Builds results and dead letters within the bytes their topics take."""

    def __init__(
        self,
        limits: ValueLimits,
        prices: Prices,
        metrics: Metrics,
        default_model: str,
        sink_of: Callable[[str], SinkSpec | None] = lambda pipeline: None,
    ) -> None:
        self.limits = limits
        self.prices = prices
        self.metrics = metrics
        self.default_model = default_model
        self.sink_of = sink_of  # a pipeline's sink, by its name (None: it has none)

    def cost(self, pipeline: str, spend: Spend) -> float:
        """The spend's cost, counted once on the cost metric."""
        split = self.prices.split(spend)
        cost = round(sum(split.values()), 8)
        if cost > 0:
            model = self.metrics.model_label(spend.model or self.default_model)
            self.metrics.cost.labels(pipeline, model, spend.tier.value).inc(cost)
            for deployment, usd in split.items():
                if usd > 0:
                    self.metrics.deployment_cost.labels(deployment or DEFAULT).inc(usd)
        return cost

    def by_deployment(self, spend: Spend) -> dict[str, float]:
        """The spend's cost per deployment that answered; {} when only the default
        endpoint did (no deployments file)."""
        parts: dict[str, float] = {}
        for name, usd in self.prices.split(spend).items():
            parts[name or DEFAULT] = round(parts.get(name or DEFAULT, 0.0) + usd, 8)
        return {} if set(parts) <= {DEFAULT} else parts

    def result(
        self,
        prep: Prepared,
        output: dict[str, Any],
        *,
        model: str,
        usage: Usage,
        cost: float,
        attempts: int,
        cached: bool,
        stages: dict[str, Any] | None = None,
        rejected: int = 0,
        by_deployment: dict[str, float] | None = None,
        unanswered: int = 0,
        digest: str | None = None,
    ) -> Outcome:
        """A result; `digest`: the definition its output was made under, when not the
        version's as it is now (a stored answer handed out again)."""
        latency_ms = (time.monotonic() - prep.started) * 1000
        record = Result(
            task_id=prep.task.task_id,
            result_key=prep.result_key,
            pipeline=prep.pipeline.name,
            prompt_version=prep.version.version,
            model=model,
            output=output,
            usage=usage,
            cost_usd=cost,
            attempts=attempts,
            latency_ms=round(latency_ms, 2),
            cached=cached,
            source=prep.source,
            trace_id=current_trace_id(),
            processed_at=now_iso(),
            rejected_answers=rejected,
            cost_by_deployment=by_deployment or {},
            unanswered_prompt_tokens=unanswered,
            prompt_digest=digest or prep.version.digest,
        ).model_dump(mode="json")
        value = orjson.dumps(record)
        reasons = tuple(prep.pipeline.review_reasons(prep.prompt.variables, output))
        outcome = Outcome(
            kind="result",
            key=prep.result_key,
            value=value,
            task_id=prep.task.task_id,
            latency_ms=latency_ms,
            attempts=attempts,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cost_usd=cost,
            unanswered_tokens=unanswered,
            output=output,
            model=model,
            stages=stages,
            stage=prep.pipeline.stages[-1].name if prep.pipeline.stages else MAIN,
            review=reasons,
            review_value=orjson.dumps({**record, "review": {"reasons": list(reasons)}})
            if reasons
            else None,
            pipeline=prep.pipeline.name,
            version=prep.version.version,
            rejected=rejected,
            cached=cached,
        )
        return self._sized(prep, outcome, record)

    def _sized(self, prep: Prepared, outcome: Outcome, record: dict[str, Any]) -> Outcome:
        """The result with its sink record, each within what its topic takes (its
        max.message.bytes and the producer's limit); else the task's dead letter."""
        if len(outcome.value) > self.limits.result:
            return self.failed(prep, OutputTooLarge(
                f"the result is {len(outcome.value)} bytes, over the "
                f"{self.limits.result} bytes the results topic takes (its max.message.bytes "
                "and the producer's limit)", code="result_too_large",
            ), outcome)  # fmt: skip
        spec = prep.pipeline.spec.sink
        if spec is None:
            return outcome
        sink = result_record(spec, prep.task, record)
        limit = self.limits.of(sink.topic)
        if len(sink.value) > limit:
            return self.failed(prep, OutputTooLarge(
                f"the sink record is {len(sink.value)} bytes, over the {limit} bytes "
                f"{sink.topic} takes (its max.message.bytes and the producer's limit)",
                code="sink_too_large",
            ), outcome)  # fmt: skip
        return replace(outcome, sink=sink)

    def cached(
        self, prep: Prepared, output: dict[str, Any], model: str, digest: str | None = None
    ) -> Outcome:
        """A result answered without an LLM call (same input answered before): no cost;
        `digest`: the definition the stored answer was made under, when it says."""
        return self.result(prep, output, model=model, usage=Usage(prompt_tokens=0,
                           completion_tokens=0), cost=0.0, attempts=0, cached=True,
                           digest=digest)  # fmt: skip

    def dead(
        self,
        exc: StreamsError,
        raw: bytes | None,
        key: bytes | None,
        task: Task | None,
        source: Source,
        attempts: Attempts,
        spend: Spend,
        started: float,
        version: str | None = None,
        pipeline: str | None = None,
    ) -> Outcome:
        """The dead letter of a record; `version`: the prompt version it was answered
        under (None: it failed before one was chosen); `pipeline`: the pipeline it was for,
        when there is no task to say so (a source record it could not map)."""
        task_id = task.task_id if task else task_id_hint(raw, key)
        pipeline = task.pipeline if task is not None else pipeline
        error = error_info(exc.category, exc.code, exc.message, exc.retryable)
        cost = self.cost(task.pipeline, spend) if task is not None else 0.0
        letter = DeadLetter(
            task_id=task_id,
            error=error,
            attempts=attempts.count,
            payload=payload_of(raw),
            source=source,
            failed_at=now_iso(),
            pipeline=pipeline,
            prompt_version=version,
            cost_usd=cost,
            unanswered_prompt_tokens=spend.unanswered_tokens,
        )
        value = dead_letter_value(letter, raw, self.limits.dead_letter)
        letter_key = task_id or f"{source.topic}/{source.partition}/{source.offset}"
        return Outcome(
            kind="dead_letter",
            key=letter_key,
            value=value,
            sink=self._copy(pipeline, letter_key, value),
            task_id=task_id,
            category=exc.category.value,
            error=error.model_dump(mode="json"),
            latency_ms=(time.monotonic() - started) * 1000,
            attempts=attempts.count,
            prompt_tokens=spend.prompt_tokens,
            completion_tokens=spend.completion_tokens,
            cost_usd=cost,
            unanswered_tokens=spend.unanswered_tokens,
            pipeline=pipeline,
            version=version,
            rejected=spend.rejected,
        )

    def failed(self, prep: Prepared, exc: StreamsError, like: Outcome) -> Outcome:
        """A dead letter for a task whose outcome `like` cannot be written as it is; the
        tokens and cost it spent stay on it (they were counted when spent)."""
        error = error_info(exc.category, exc.code, exc.message, exc.retryable)
        letter = DeadLetter(task_id=prep.task.task_id, error=error, attempts=like.attempts,
                            payload=payload_of(prep.raw), source=prep.source,
                            failed_at=now_iso(), pipeline=prep.pipeline.name,
                            prompt_version=prep.version.version,
                            cost_usd=like.cost_usd,
                            unanswered_prompt_tokens=like.unanswered_tokens)  # fmt: skip
        value = dead_letter_value(letter, prep.raw, self.limits.dead_letter)
        return Outcome(
            kind="dead_letter",
            key=prep.task.task_id,
            value=value,
            sink=self._copy(prep.pipeline.name, prep.task.task_id, value),
            task_id=prep.task.task_id,
            category=exc.category.value,
            error=error.model_dump(mode="json"),
            latency_ms=like.latency_ms,
            attempts=like.attempts,
            prompt_tokens=like.prompt_tokens,
            completion_tokens=like.completion_tokens,
            cost_usd=like.cost_usd,
            unanswered_tokens=like.unanswered_tokens,
            pipeline=prep.pipeline.name,
            version=prep.version.version,
            rejected=like.rejected,
        )

    def _copy(self, pipeline: str | None, key: str, letter: bytes) -> SinkRecord | None:
        """A dead letter's copy for its pipeline's own dead-letter topic, if it has one."""
        spec = self.sink_of(pipeline) if pipeline is not None else None
        return dead_letter_record(spec, key, letter) if spec is not None else None


def stored(prep: Prepared, kind: str, key: str, raw: bytes, record: dict[str, Any]) -> Outcome:
    """An outcome as an earlier run wrote it (its sink record too, which that run may not
    have written: it was killed after the outcome)."""
    error = record.get("error") if kind == "dead_letter" else None
    spec = prep.pipeline.spec.sink
    sink: SinkRecord | None = None
    if spec is not None and kind == "result" and isinstance(record.get("output"), dict):
        sink = result_record(spec, prep.task, record)
    elif spec is not None and kind == "dead_letter":
        sink = dead_letter_record(spec, key, raw)
    return Outcome(
        sink=sink,
        kind="result" if kind == "result" else "dead_letter",
        key=key,
        value=raw,
        task_id=prep.task.task_id,
        category=(error or {}).get("category"),
        error=error,
        attempts=int(record.get("attempts", 0)),
    )


__all__ = ["Outcome", "Outcomes", "Prepared", "stored"]
