"""One task from raw bytes to exactly one outcome: a result or a dead letter.

`prepare` decodes and renders a record (`core.intake`; or makes its dead letter); `answer`
runs the task within its deadline — its first stage (in chunks when the input
is over its budget, in a pack when the pipeline packs short inputs, shortened
once when the provider says the prompt is over its window), then any later
stages — through `Calls` (retries, fallbacks, tiers, the output contract), and
builds the outcome through `Outcomes`. It never raises for a bad task: a bug is
an `internal_error` dead letter.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from streams.contract.lanes import Lane, Tier
from streams.contract.records import (
    Source,
    Usage,
    ValueLimits,
)
from streams.core.batch import BatchLane, Parking
from streams.core.budget import Budgets
from streams.core.calls import Calls, ClientFor, RouteFor
from streams.core.chunks import Chunks
from streams.core.intake import Intake
from streams.core.outcome import Outcome, Outcomes, Prepared
from streams.core.packs import Packs
from streams.core.spend import Prices, Spend
from streams.core.stages import MAIN, StageFailed, run_stages
from streams.core.window import budget_overflowed, chunk_plan, shorten
from streams.errors import (
    ContextOverflow,
    DeadlineExceeded,
    InternalError,
    NotOurs,
    StreamsError,
    TaskError,
)
from streams.llm.client import completion_budget
from streams.llm.deployments import Deployment
from streams.llm.tokens import count_messages
from streams.observability.metrics import Metrics
from streams.observability.tracing import stage_span
from streams.pipelines.pipeline import Pipeline
from streams.pipelines.registry import PipelineRegistry
from streams.pipelines.render import PipelineVersion, RenderedPrompt
from streams.resilience.guarded import GuardedClient
from streams.resilience.limiter import GroupShare
from streams.resilience.retry import Attempts, RetryPolicy
from streams.settings import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcessorConfig:
    """What the processor is told once: limits, prices, the model's window."""

    default_model: str = "gpt-4o-mini"
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    deadline_s: float = 120.0
    batch_deadline_s: float = 93_600.0  # the batch tier: a batch may take a day
    max_task_bytes: int = 65_536
    prices: Prices = field(default_factory=Prices)
    # The model's window when a setting says it (None: told by the endpoint or learned).
    context_window: int | None = None
    limits: ValueLimits = field(default_factory=ValueLimits)

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        limits: ValueLimits | None = None,
        deployments: Sequence[Deployment] = (),
    ) -> ProcessorConfig:
        llm = settings.llm
        return cls(
            default_model=llm.model,
            policy=RetryPolicy(
                max_attempts=llm.max_attempts,
                backoff_base_s=llm.backoff_base_s,
                backoff_max_s=llm.backoff_max_s,
            ),
            deadline_s=llm.task_deadline_s,
            batch_deadline_s=settings.batch_api.deadline_s,
            max_task_bytes=settings.batch.max_task_bytes,
            prices=Prices.from_settings(settings, deployments),
            context_window=llm.context_window,
            limits=limits or ValueLimits(),
        )


class TaskProcessor:
    """Decode, render, call with retries, validate; never raises for a bad task."""

    def __init__(
        self,
        registry: PipelineRegistry,
        client: GuardedClient,
        config: ProcessorConfig,
        *,
        clients: ClientFor | None = None,
        routes: RouteFor | None = None,
        metrics: Metrics | None = None,
        close: Callable[[], Awaitable[None]] | None = None,
        group: GroupShare | None = None,
        budgets: Budgets | None = None,
    ) -> None:
        self.registry = registry
        self.config = config
        self.metrics = metrics or Metrics()
        # Spend caps (`group`: the worker's part of its group, which holds its share).
        self.budgets = budgets or Budgets(group=group, metrics=self.metrics)
        # Whether this worker still owns a task partition (the edge says; a task waiting
        # at a spend cap is given up with its partition).
        self.owns: Callable[[int], bool] = lambda partition: True
        self._completions: dict[str, tuple[float, int]] = {}  # per pipeline: tokens, tasks
        if config.context_window is not None:
            client.window.configured = config.context_window
        self.calls = Calls(client, policy=config.policy, metrics=self.metrics, clients=clients,
                           routes=routes)  # fmt: skip
        self.packs = Packs(self.calls, registry)
        self.chunks = Chunks(self.calls, self.metrics, config.default_model)
        self.outcomes = Outcomes(config.limits, config.prices, self.metrics, config.default_model,
                                 sink_of=registry.sink_of)  # fmt: skip
        self.intake = Intake(registry, self.outcomes, self.metrics,
                             default_model=config.default_model,
                             max_task_bytes=config.max_task_bytes)  # fmt: skip
        self._close = close

    @property
    def client(self) -> GuardedClient:
        return self.calls.client

    @property
    def batches(self) -> BatchLane | None:
        return self.calls.batches

    @batches.setter
    def batches(self, lane: BatchLane | None) -> None:
        self.calls.batches = lane

    async def close(self) -> None:
        """Close every HTTP client the processor used."""
        if self.batches is not None:
            await self.batches.close()
        await (self._close() if self._close is not None else self.client.close())

    async def process(
        self, raw: bytes | None, key: bytes | None, source: Source, lane: Lane = Lane.LIVE
    ) -> Outcome:
        """Prepare, then answer with the LLM: one outcome for one record."""
        prepared = self.intake.prepare(raw, key, source)
        if isinstance(prepared, Outcome):
            return prepared
        return await self.answer(prepared, lane)

    def dead_letter(
        self,
        exc: StreamsError,
        raw: bytes | None,
        key: bytes | None,
        source: Source,
        pipeline: str | None = None,
    ) -> Outcome:
        """The dead letter of a record that met `exc` outside the processor's own steps
        (`pipeline`: the one it was for, when known: a source record it could not map)."""
        return self.outcomes.dead(exc, raw, key, None, source, Attempts(), Spend(),
                                  time.monotonic(), pipeline=pipeline)  # fmt: skip

    def failed(self, prep: Prepared, exc: StreamsError, like: Outcome) -> Outcome:
        return self.outcomes.failed(prep, exc, like)

    def from_cache(
        self, prep: Prepared, output: dict[str, Any], model: str, digest: str | None = None
    ) -> Outcome:
        return self.outcomes.cached(prep, output, model, digest)

    def tier_for(self, pipeline: Pipeline, lane: Lane, asked: Tier | None = None) -> Tier:
        """The price tier a task runs in: asked (a replay's --lane), else the pipeline's
        lane policy; batch only in the replay lane and when the worker has a batch lane."""
        tier = Tier(asked or pipeline.spec.lanes.of(lane.name.lower()))
        if tier is Tier.BATCH and (lane is not Lane.REPLAY or self.batches is None):
            return Tier.SYNC
        return tier

    async def answer(
        self,
        prep: Prepared,
        lane: Lane = Lane.LIVE,
        earlier: dict[str, Any] | None = None,
        tier: Tier | None = None,
    ) -> Outcome:
        """Call the LLM (retries, fallbacks, mitigation) and validate: result or dead letter.

        `earlier`: answers by stage of an earlier run of this task and version that
        failed at a later stage; they are used, not asked again. `tier`: sync, flex or
        batch (see `tier_for`). A pipeline at its spend cap, or whose model's deployments
        are all at theirs, waits here, before the deadline starts (`core.budget`)."""
        spend = Spend(tier=self.tier_for(prep.pipeline, lane, tier))
        pipeline, partition = prep.pipeline.name, prep.source.partition
        budget = self.budgets.caps(pipeline, prep.pipeline.spec.budget)
        if not self.budgets.deployment_caps and budget is None:
            return await self._answer(prep, lane, earlier, spend)
        held = hold = None
        try:  # what the waits reserved is given back whatever ends them (withdrawn, cancelled)
            if self.budgets.deployment_caps:
                names = [m.name for m in self.calls.route_for(prep.prompt.model).members]
                held = await self.budgets.deployments_room(
                    pipeline, names, lane, self._estimate(prep, spend.tier),
                    owned=lambda: self.owns(partition),
                )  # fmt: skip
            if budget is not None:
                hold = await self.budgets.hold(pipeline, budget, lane,
                                               self._estimate(prep, spend.tier),
                                               owned=lambda: self.owns(partition),
                                               partition=partition)  # fmt: skip
            return await self._answer(prep, lane, earlier, spend)
        finally:  # whatever the end (a dead letter, parked, cancelled): what it cost
            costs = self.outcomes.prices.capped(spend)
            self.budgets.book(costs, partition)
            if held is not None:
                held.settle(0.0)
            if hold is not None:
                hold.settle(round(sum(costs.values()), 8))
                tokens, tasks = self._completions.get(pipeline, (0.0, 0))
                if spend.completion_tokens:
                    self._completions[pipeline] = (tokens + spend.completion_tokens,
                                                   tasks + 1)  # fmt: skip

    def _estimate(self, prep: Prepared, tier: Tier) -> float:
        """What a task's calls may cost: its prompt, and the answer its pipeline's tasks
        took so far on average (at first, the answer's whole budget)."""
        tokens, tasks = self._completions.get(prep.pipeline.name, (0.0, 0))
        completion = tokens / tasks if tasks else completion_budget(prep.prompt.params)
        return self.outcomes.prices.estimate(count_messages(prep.prompt.messages), completion,
                                             tier)  # fmt: skip

    async def _answer(
        self, prep: Prepared, lane: Lane, earlier: dict[str, Any] | None, spend: Spend
    ) -> Outcome:
        """The task answered within its deadline: a result, or its dead letter."""
        pipeline, version = prep.pipeline, prep.version
        attempts = Attempts()
        deadline_s = self.config.deadline_s
        if spend.tier is Tier.BATCH:
            spend.route = (prep.source.partition, prep.result_key)
            if prep.record is not None:
                spend.parking = Parking(prep.result_key, prep.record)
            deadline_s = self.config.batch_deadline_s
        deadline_at = self.client.clock.now() + deadline_s
        done: dict[str, Any] = dict(earlier or {}) if pipeline.stages else {}
        kept = done if pipeline.stages else None
        try:
            try:
                async with asyncio.timeout(deadline_s):
                    output, prompt = await self._stages(prep, done, attempts, spend, lane,
                                                        deadline_at)  # fmt: skip
            except TimeoutError:
                last = attempts.last_error
                cause = f"; last error: {last.category.value}: {last.message}" if last else ""
                raise DeadlineExceeded(
                    f"task deadline of {deadline_s:g}s passed after "
                    f"{attempts.count} attempt(s){cause}",
                    code="task_deadline",
                ) from None
            usage = Usage(prompt_tokens=spend.prompt_tokens,
                          completion_tokens=spend.completion_tokens,
                          cached_prompt_tokens=spend.cached_prompt)  # fmt: skip
            return self.outcomes.result(
                prep, output, model=spend.model or prompt.model, usage=usage,
                cost=self.outcomes.cost(pipeline.name, spend), attempts=attempts.count,
                cached=False, stages=kept, rejected=spend.rejected,
                by_deployment=self.outcomes.by_deployment(spend),
                unanswered=spend.unanswered_tokens,
            )  # fmt: skip
        except TaskError as exc:
            dead = self.outcomes.dead(exc, prep.raw, prep.key, prep.task, prep.source, attempts,
                                      spend, prep.started, version.version)  # fmt: skip
            if kept is None:
                return dead
            failed_at = exc.stage if isinstance(exc, StageFailed) else MAIN
            return replace(dead, stages=kept, stage=failed_at)
        except NotOurs:
            raise  # its partition is not this worker's any more: no outcome here
        except Exception as exc:  # a bug must not stop the worker or lose the record
            log.exception("unexpected error processing %s", prep.source)
            err = InternalError(f"internal error: {exc!r}", code="internal_error")
            return self.outcomes.dead(err, prep.raw, prep.key, prep.task, prep.source, attempts,
                                      spend, prep.started, version.version)  # fmt: skip

    async def _stages(
        self,
        prep: Prepared,
        done: dict[str, Any],
        attempts: Attempts,
        spend: Spend,
        lane: Lane,
        deadline_at: float,
    ) -> tuple[dict[str, Any], RenderedPrompt]:
        """The first stage's answer (unless `done` holds it), then the later stages'
        (those not in `done`); the output and the prompt of the first stage."""
        pipeline, version, prompt = prep.pipeline, prep.version, prep.prompt
        if MAIN in done:
            output = done[MAIN]
        else:
            with stage_span(MAIN, pipeline.name, version.version):
                output, prompt = await self._main(prep, prompt, attempts, spend, lane,
                                                  deadline_at)  # fmt: skip
            done[MAIN] = output
        if not pipeline.stages:
            return output, prompt

        async def call(p: Pipeline, v: PipelineVersion, r: RenderedPrompt) -> dict[str, Any]:
            # A stage's attempts count on from the ones before it.
            attempts.previous, attempts.last_error = attempts.count, None
            return await self.calls.call(p, v, r, attempts, spend, lane, deadline_at)

        answers = await run_stages(
            pipeline.stages, variables=prompt.variables, output=output, done=done,
            task_id=prep.task.task_id, default_model=self.config.default_model, call=call,
        )  # fmt: skip
        return {**output, "stages": answers}, prompt

    async def _main(
        self,
        prep: Prepared,
        prompt: RenderedPrompt,
        attempts: Attempts,
        spend: Spend,
        lane: Lane,
        deadline_at: float,
    ) -> tuple[dict[str, Any], RenderedPrompt]:
        """The first stage's answer, and the prompt it came from: in chunks when the
        input is over the budget and the pipeline chunks; in a pack when it is short and
        the pipeline packs; shortened when the prompt is over the window and the version
        truncates."""
        pipeline, version = prep.pipeline, prep.version
        window = await self.client.context_window(prompt.model)
        chunks = chunk_plan(pipeline, prompt, window)
        if chunks is not None:
            output = await self.chunks.answer(prep, prompt, chunks, attempts, spend, lane,
                                              deadline_at)  # fmt: skip
            return output, prompt
        packed = await self.packs.answer(prep, prompt, attempts, spend, lane, deadline_at)
        if packed is not None:
            return packed, prompt
        try:
            return await self.calls.call(
                pipeline, version, prompt, attempts, spend, lane, deadline_at
            ), prompt
        except ContextOverflow as exc:
            return await self._overflowed(prep, prompt, exc, window, attempts, spend, lane,
                                          deadline_at)  # fmt: skip

    async def _overflowed(
        self,
        prep: Prepared,
        prompt: RenderedPrompt,
        exc: ContextOverflow,
        window: int,
        attempts: Attempts,
        spend: Spend,
        lane: Lane,
        deadline_at: float,
    ) -> tuple[dict[str, Any], RenderedPrompt]:
        """The provider refused the prompt as over its window, which may be smaller than
        assumed: the input in chunks of it when the pipeline chunks; else the version's
        mitigation (shorten, try once more), or the overflow's dead letter."""
        pipeline, version = prep.pipeline, prep.version
        learned = self.client.window.tokens()
        chunks = chunk_plan(pipeline, prompt, learned) if learned < window else None
        attempts.previous, attempts.last_error = attempts.count, None
        if chunks is not None:
            output = await self.chunks.answer(prep, prompt, chunks, attempts, spend, lane,
                                              deadline_at)  # fmt: skip
            return output, prompt
        if budget_overflowed(prompt.messages, prompt.params, exc, learned):
            try:  # asked again, its budget fitted to the window now known: the input whole
                return await self.calls.call(
                    pipeline, version, prompt, attempts, spend, lane, deadline_at
                ), prompt
            except ContextOverflow as again:  # the server counts the prompt longer: cut it
                exc = again
        prompt = shorten(version, prep.task.input, prompt, exc, context_window=learned,
                         default_model=self.config.default_model)  # fmt: skip
        self.metrics.mitigations.labels(pipeline.name, "truncate").inc()
        return await self.calls.call(
            pipeline, version, prompt, attempts, spend, lane, deadline_at
        ), prompt


__all__ = ["Outcome", "Prepared", "Prices", "ProcessorConfig", "TaskProcessor"]
