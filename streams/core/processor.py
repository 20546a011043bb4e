"""One task from raw bytes to exactly one outcome: a result or a dead letter."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import orjson
from opentelemetry.trace import SpanKind

from streams.contract.lanes import Lane
from streams.contract.records import (
    DeadLetter,
    RecordRoom,
    Result,
    Source,
    Task,
    Usage,
    content_key,
    dead_letter_value,
    decode_task,
    error_info,
    now_iso,
    payload_of,
    result_key,
    task_id_hint,
)
from streams.core.batches import BatchLane
from streams.core.chunking import reduce_outputs, split_text
from streams.core.packing import (
    Item,
    PackedAnswer,
    Packer,
    packed_messages,
    packed_schema,
    shares,
    split_answers,
)
from streams.core.stages import MAIN, StageFailed, run_stages
from streams.errors import (
    BadRequest,
    CircuitOpen,
    ContextOverflow,
    DeadlineExceeded,
    InternalError,
    InvalidOutput,
    OutputRejected,
    OutputTooLarge,
    RateLimited,
    StreamsError,
    TaskError,
)
from streams.llm.client import LLMRequest, LLMResponse
from streams.llm.tokens import count_messages, counter, truncate_tokens
from streams.observability.metrics import Metrics
from streams.observability.tracing import TRACER, current_trace_id, mark_error, stage_span
from streams.pipelines.output import check_output, parse_output
from streams.pipelines.registry import (
    Fallback,
    Pipeline,
    PipelineRegistry,
    PipelineVersion,
    RenderedPrompt,
)
from streams.resilience.guarded import CAPACITY_CODES, DEFAULT_MAX_TOKENS, GuardedClient
from streams.resilience.retry import Attempts, RetryPolicy, call_with_retries

log = logging.getLogger(__name__)

# OpenAI's context_length_exceeded message: "This model's maximum context length is N
# tokens. However, you requested M tokens (P in the messages, C in the completion)."
_WINDOW_RE = re.compile(r"maximum context length is (\d+)")
# Share of the context window a request may fill (prompt + answer budget), and the
# smallest answer budget worth a call.
WINDOW_SHARE = 0.85
MIN_COMPLETION_TOKENS = 64
_REQUESTED_RE = re.compile(r"\((\d+) in the messages, (\d+) in the completion\)")


@dataclass(frozen=True)
class Prices:
    """USD per 1,000 tokens."""

    prompt_per_1k: float = 0.0
    completion_per_1k: float = 0.0

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return round(
            prompt_tokens * self.prompt_per_1k / 1000
            + completion_tokens * self.completion_per_1k / 1000,
            8,
        )


@dataclass(frozen=True)
class Outcome:
    """What to write for one input record."""

    kind: Literal["result", "dead_letter"]
    key: str
    value: bytes
    task_id: str | None
    category: str | None = None
    latency_ms: float = 0.0
    attempts: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    output: dict[str, Any] | None = None
    model: str | None = None
    # Multi-stage pipelines: every answer known so far by stage name (kept in the task
    # state, so a re-run resumes from the stage that failed), and where it ended.
    stages: dict[str, Any] | None = None
    stage: str = "main"
    review: tuple[str, ...] = ()  # reasons this result also goes to the review topic


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


@dataclass
class _Spend:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    model: str = ""
    calls: list[str] = field(default_factory=list)
    last_prompt_tokens: int = 0
    repair_tokens: int = 0
    tier: str = "sync"  # sync | flex | batch: how calls are made and priced
    route: tuple[int, str] | None = None  # batch tier: (partition, custom_id)
    discounted_prompt: int = 0  # tokens billed at the batch/flex price
    discounted_completion: int = 0


class TaskProcessor:
    """Decode, render, call with retries, validate; never raises for a bad task."""

    def __init__(
        self,
        registry: PipelineRegistry,
        client: GuardedClient,
        *,
        default_model: str,
        policy: RetryPolicy,
        deadline_s: float,
        max_task_bytes: int,
        prices: Prices,
        context_window: int = 128_000,
        clients: Callable[[str, str | None, str | None], GuardedClient] | None = None,
        close: Callable[[], Awaitable[None]] | None = None,
        metrics: Metrics | None = None,
        batch_deadline_s: float = 93_600.0,
        tier_price_ratio: float = 0.5,
        room: RecordRoom | None = None,
    ) -> None:
        self.registry = registry
        self.client = client
        self.default_model = default_model
        self.policy = policy
        self.deadline_s = deadline_s
        self.max_task_bytes = max_task_bytes
        self.prices = prices
        self.context_window = context_window
        self.clients = clients
        self._close = close
        self.metrics = metrics
        self.packer = Packer(self._send_pack)
        self.batches: BatchLane | None = None  # the batch tier, when the worker has one
        self.batch_deadline_s = batch_deadline_s
        self.tier_price_ratio = tier_price_ratio
        self.room = room or RecordRoom()

    async def close(self) -> None:
        """Close every HTTP client the processor used."""
        if self.batches is not None:
            await self.batches.close()
        await (self._close() if self._close is not None else self.client.close())

    async def process(
        self, raw: bytes | None, key: bytes | None, source: Source, lane: Lane = Lane.LIVE
    ) -> Outcome:
        """Prepare, then answer with the LLM: one outcome for one record."""
        prepared = self.prepare(raw, key, source)
        if isinstance(prepared, Outcome):
            return prepared
        return await self.answer(prepared, lane)

    def prepare(self, raw: bytes | None, key: bytes | None, source: Source) -> Prepared | Outcome:
        """Decode and render a record: a task ready to answer, or its dead letter."""
        started = time.monotonic()
        task: Task | None = None
        try:
            task = decode_task(raw, max_bytes=self.max_task_bytes)
            pipeline = self.registry.get(task.pipeline)
            version = pipeline.version(task.prompt_version, task.task_id)
            prompt = version.render(task.input, self.default_model)
            if self.metrics is not None:
                chosen_by = ("pinned" if task.prompt_version else
                             "split" if pipeline.spec.traffic else "default")  # fmt: skip
                self.metrics.versions_chosen.labels(pipeline.name, version.version, chosen_by).inc()
            if prompt.redactions and self.metrics is not None:
                for kind, n in prompt.redactions.items():
                    self.metrics.redactions.labels(pipeline.name, kind).inc(n)
            return Prepared(
                task=task,
                pipeline=pipeline,
                version=version,
                prompt=prompt,
                result_key=result_key(pipeline.name, version.version, task.task_id, task.input),
                content_key=content_key(pipeline.name, version.version, task.input),
                raw=raw,
                key=key,
                source=source,
                started=started,
            )
        except TaskError as exc:
            return self._dead(exc, raw, key, task, source, Attempts(), _Spend(), started)
        except Exception as exc:  # a bug must not stop the worker or lose the record
            log.exception("unexpected error preparing %s", source)
            err = InternalError(f"internal error: {exc!r}", code="internal_error")
            return self._dead(err, raw, key, task, source, Attempts(), _Spend(), started)

    def dead_letter(
        self, exc: StreamsError, raw: bytes | None, key: bytes | None, source: Source
    ) -> Outcome:
        """The dead letter of a record that met `exc` outside the processor's own steps."""
        return self._dead(exc, raw, key, None, source, Attempts(), _Spend(), time.monotonic())

    def tier_for(self, pipeline: Pipeline, lane: Lane, asked: str | None = None) -> str:
        """The price tier a task runs in: asked (a replay's --lane), else the pipeline's
        lane policy; batch only in the replay lane and when the worker has a batch lane."""
        tier = asked or pipeline.spec.lanes.of(lane.name.lower())
        if tier == "batch" and (lane is not Lane.REPLAY or self.batches is None):
            return "sync"
        return tier

    async def answer(
        self,
        prep: Prepared,
        lane: Lane = Lane.LIVE,
        earlier: dict[str, Any] | None = None,
        tier: str | None = None,
    ) -> Outcome:
        """Call the LLM (retries, fallbacks, mitigation) and validate: result or dead letter.

        `earlier`: answers by stage of an earlier run of this task and version that
        failed at a later stage; they are used, not asked again. `tier`: sync, flex or
        batch (see `tier_for`)."""
        task, pipeline, version, prompt = prep.task, prep.pipeline, prep.version, prep.prompt
        attempts = Attempts()
        spend = _Spend(tier=self.tier_for(pipeline, lane, tier))
        deadline_s = self.deadline_s
        if spend.tier == "batch":
            spend.route = (prep.source.partition, prep.result_key)
            deadline_s = self.batch_deadline_s
        deadline_at = self.client.clock.now() + deadline_s
        done: dict[str, Any] = dict(earlier or {}) if pipeline.stages else {}
        kept = done if pipeline.stages else None
        try:
            try:
                async with asyncio.timeout(deadline_s):
                    if MAIN in done:
                        output = done[MAIN]
                    else:
                        with stage_span(MAIN, pipeline.name, version.version):
                            output, prompt = await self._main(
                                prep, prompt, attempts, spend, lane, deadline_at
                            )
                        done[MAIN] = output
                    if pipeline.stages:

                        async def call(
                            p: Pipeline, v: PipelineVersion, r: RenderedPrompt
                        ) -> dict[str, Any]:
                            # A stage's attempts count on from the ones before it.
                            attempts.previous, attempts.last_error = attempts.count, None
                            return await self._call(p, v, r, attempts, spend, lane, deadline_at)

                        answers = await run_stages(
                            pipeline.stages, variables=prompt.variables, output=output,
                            done=done, task_id=task.task_id, default_model=self.default_model,
                            call=call,
                        )  # fmt: skip
                        output = {**output, "stages": answers}
            except TimeoutError:
                last = attempts.last_error
                cause = f"; last error: {last.category.value}: {last.message}" if last else ""
                raise DeadlineExceeded(
                    f"task deadline of {deadline_s:g}s passed after "
                    f"{attempts.count} attempt(s){cause}",
                    code="task_deadline",
                ) from None
            cost = self._cost(spend)
            self._count_cost(pipeline.name, spend, cost)
            return self._result(
                prep,
                output,
                model=spend.model or prompt.model,
                usage=Usage(
                    prompt_tokens=spend.prompt_tokens, completion_tokens=spend.completion_tokens
                ),
                cost=cost,
                attempts=attempts.count,
                cached=False,
                stages=kept,
            )
        except TaskError as exc:
            dead = self._dead(exc, prep.raw, prep.key, task, prep.source, attempts, spend,
                              prep.started)  # fmt: skip
            if kept is None:
                return dead
            failed_at = exc.stage if isinstance(exc, StageFailed) else MAIN
            return replace(dead, stages=kept, stage=failed_at)
        except Exception as exc:  # a bug must not stop the worker or lose the record
            log.exception("unexpected error processing %s", prep.source)
            err = InternalError(f"internal error: {exc!r}", code="internal_error")
            return self._dead(err, prep.raw, prep.key, task, prep.source, attempts, spend,
                              prep.started)  # fmt: skip

    async def _main(
        self,
        prep: Prepared,
        prompt: RenderedPrompt,
        attempts: Attempts,
        spend: _Spend,
        lane: Lane,
        deadline_at: float,
    ) -> tuple[dict[str, Any], RenderedPrompt]:
        """The first stage's answer, and the prompt it came from: in chunks when the
        input is over the budget and the pipeline chunks; shortened when the prompt is
        over the window and the version truncates."""
        pipeline, version, task = prep.pipeline, prep.version, prep.task
        chunks = self._chunks(pipeline, prompt)
        if chunks is not None:
            output = await self._answer_chunks(
                prep, prompt, chunks, attempts, spend, lane, deadline_at
            )
            return output, prompt
        packing = pipeline.spec.packing
        short = packing is not None and len(str(prompt.variables.get(packing.slot) or "")) <= (
            packing.max_chars
        )
        if short and spend.tier != "batch":  # a batch already halves the price
            packed = await self._packed(prep, prompt, lane, deadline_at)
            spend.prompt_tokens += packed.prompt_tokens
            spend.completion_tokens += packed.completion_tokens
            spend.model = packed.model or spend.model
            attempts.count = attempts.previous + packed.calls
            attempts.previous = attempts.count
            if self.metrics is not None:
                outcome = "packed" if packed.output is not None else "alone"
                self.metrics.packed.labels(pipeline.name, outcome).inc()
            if packed.output is not None:
                return packed.output, prompt
            log.info("task %s: %s; answering it alone", task.task_id, packed.reason)
        try:
            return await self._call(
                pipeline, version, prompt, attempts, spend, lane, deadline_at
            ), prompt
        except ContextOverflow as exc:
            # The pipeline's mitigation, if any: shorten, try once more.
            prompt = self._shorten(pipeline, version, task, prompt, exc)
            attempts.previous, attempts.last_error = attempts.count, None
            return await self._call(
                pipeline, version, prompt, attempts, spend, lane, deadline_at
            ), prompt

    async def _packed(
        self, prep: Prepared, prompt: RenderedPrompt, lane: Lane, deadline_at: float
    ) -> PackedAnswer:
        """This task's answer from a pack it shares with others (or None inside: alone)."""
        pipeline, version = prep.pipeline, prep.version
        packing = pipeline.spec.packing
        assert packing is not None
        system = prompt.messages[0]["content"]
        key = (pipeline.name, version.version, prompt.model, lane.name, system)

        def check(data: Any) -> dict[str, Any]:
            return check_output(data, pipeline, prompt.variables)

        item = Item(prep.task.task_id, prompt, deadline_at, check)
        return await self.packer.submit(key, item, packing.max_items, packing.linger_s)

    async def _send_pack(self, key: tuple[str, str, str, str, str], items: list[Item]) -> None:
        """One request for the items; each gets its own answer, or None to go alone."""
        pipeline = self.registry.get(key[0])
        lane = Lane[key[3]]
        seen: set[str] = set()
        unique = []
        for item in items:
            if item.task_id in seen:
                item.settle(PackedAnswer(None, reason="its task id is twice in the pack"))
            else:
                seen.add(item.task_id)
                unique.append(item)
        items = unique
        first = items[0].prompt
        messages = packed_messages(
            key[4], [(i.task_id, i.prompt.messages[-1]["content"]) for i in items]
        )
        budget_key = (
            "max_completion_tokens" if "max_completion_tokens" in first.params else ("max_tokens")
        )
        per_item = int(first.params.get(budget_key) or DEFAULT_MAX_TOKENS)
        response_format: dict[str, Any] = (
            {"type": "json_schema", "json_schema": {
                "name": pipeline.name.replace("-", "_") + "_packed",
                "schema": packed_schema(pipeline.output_schema), "strict": True}}
            if first.response_format.get("type") == "json_schema"
            else {"type": "json_object"}
        )  # fmt: skip
        attempts = Attempts()
        try:
            params = self._fit_window(
                messages, {**first.params, budget_key: per_item * len(items)}, first.params
            )
            request = LLMRequest(messages=messages, model=first.model, params=params,
                                 response_format=response_format)  # fmt: skip
            deadline_at = min(i.deadline_at for i in items)

            async def attempt(a: Attempts) -> LLMResponse:
                with TRACER.start_as_current_span(
                    f"chat {first.model}", kind=SpanKind.CLIENT,
                    attributes={"gen_ai.operation.name": "chat", "gen_ai.system": "openai",
                                "gen_ai.request.model": first.model,
                                "llm_streams.pack_size": len(items),
                                "llm_streams.attempt": a.count},
                ):  # fmt: skip
                    response = await self.client.complete(
                        request, lane=lane, deadline_at=deadline_at
                    )
                if response.finish_reason == "length":
                    raise OutputRejected("pack answer cut at max_tokens", code="truncated")
                return response

            response = await call_with_retries(attempt, self.policy, attempts)
        except TaskError as exc:
            for item in items:
                item.settle(PackedAnswer(None, reason=f"pack failed ({exc.category.value}: "
                                         f"{exc.message})", calls=attempts.count))  # fmt: skip
            return
        ids = [i.task_id for i in items]
        answers = split_answers(response.content, ids)
        prompt_parts = shares(response.prompt_tokens,
                              [len(i.prompt.messages[-1]["content"]) for i in items])  # fmt: skip
        completion_parts = shares(
            response.completion_tokens,
            [len(orjson.dumps(answers[i])) if i in answers else 0 for i in ids],
        )
        for item, prompt_tokens, completion_tokens in zip(
            items, prompt_parts, completion_parts, strict=True
        ):
            paid = PackedAnswer(None, prompt_tokens=prompt_tokens,
                                completion_tokens=completion_tokens, model=response.model,
                                calls=attempts.count)  # fmt: skip
            if item.task_id not in answers:
                item.settle(replace(paid, reason="missing from the pack's answer"))
                continue
            try:
                output = item.check(answers[item.task_id])
            except InvalidOutput as exc:
                self._count_output(response.model, ok=False)
                item.settle(replace(paid, reason=f"invalid in the pack: {exc.message}"))
                continue
            self._count_output(response.model, ok=True)
            item.settle(replace(paid, output=output))

    def _chunks(self, pipeline: Pipeline, prompt: RenderedPrompt) -> list[str] | None:
        """The chunks of the pipeline's chunking slot, or None when it fits as it is."""
        spec = pipeline.spec.chunking
        if spec is None:
            return None
        text = str(prompt.variables.get(spec.slot) or "")
        answer = int(
            prompt.params.get("max_completion_tokens")
            or prompt.params.get("max_tokens")
            or DEFAULT_MAX_TOKENS
        )
        usable = int(self.context_window * WINDOW_SHARE) - answer  # for the prompt
        # UTF-8 bytes bound the tokens from above: most inputs need no count (and the
        # tokenizer's tables are loaded only once one does).
        if spec.max_tokens is not None:
            budget = spec.max_tokens
            if len(text.encode()) <= budget:
                return None
            count = counter()
            if count(text) <= budget:
                return None
        else:
            if sum(len(m["content"].encode()) + 8 for m in prompt.messages) <= usable:
                return None
            count = counter()
            text_tokens = count(text)
            budget = usable - (count_messages(prompt.messages) - text_tokens)
            if text_tokens <= budget:
                return None
            if budget < 32:
                raise ContextOverflow(
                    f"the prompt around input.{spec.slot} leaves {budget} tokens of the "
                    f"{self.context_window}-token window for it",
                    code="context_overflow",
                )
        chunks = split_text(text, budget, min(spec.overlap_tokens, budget // 4), count)
        if len(chunks) > spec.max_chunks:
            raise ContextOverflow(
                f"input.{spec.slot} needs {len(chunks)} chunks of {budget} tokens, over the "
                f"pipeline's max_chunks of {spec.max_chunks}",
                code="too_many_chunks",
            )
        return chunks

    async def _answer_chunks(
        self,
        prep: Prepared,
        prompt: RenderedPrompt,
        chunks: list[str],
        attempts: Attempts,
        spend: _Spend,
        lane: Lane,
        deadline_at: float,
    ) -> dict[str, Any]:
        """Each chunk answered on its own (a few at once), the answers merged."""
        pipeline, version, task = prep.pipeline, prep.version, prep.task
        spec = pipeline.spec.chunking
        assert spec is not None
        gate = asyncio.Semaphore(spec.parallel)

        async def one(chunk: str) -> tuple[dict[str, Any] | TaskError, Attempts, _Spend]:
            mine, used = Attempts(), _Spend()
            async with gate:
                rendered = version.render({**task.input, spec.slot: chunk}, self.default_model)
                rendered = replace(rendered, model=prompt.model)
                try:
                    output = await self._call(
                        pipeline, version, rendered, mine, used, lane, deadline_at
                    )
                except TaskError as exc:
                    return exc, mine, used
                return output, mine, used

        answers = await asyncio.gather(*(one(chunk) for chunk in chunks))
        for _, mine, used in answers:
            attempts.count = attempts.previous + mine.count
            attempts.previous = attempts.count
            spend.prompt_tokens += used.prompt_tokens
            spend.completion_tokens += used.completion_tokens
            spend.model = used.model or spend.model
            spend.last_prompt_tokens = max(spend.last_prompt_tokens, used.last_prompt_tokens)
        if self.metrics is not None:
            self.metrics.mitigations.labels(pipeline.name, "chunk").inc()
            self.metrics.chunks.labels(pipeline.name).inc(len(chunks))
        for i, (answer, _, _) in enumerate(answers):
            if isinstance(answer, TaskError):
                attempts.last_error = answer
                answer.message = f"chunk {i + 1} of {len(chunks)}: {answer.message}"
                raise answer
        outputs = [a for a, _, _ in answers if isinstance(a, dict)]
        merged = reduce_outputs(outputs, spec.reduce, pipeline.output_schema, spec.weight_field)
        if not pipeline.is_valid(merged):
            errors = sorted(pipeline.validator.iter_errors(merged), key=lambda e: e.path)[:3]
            raise OutputRejected(
                f"the merged answer of {len(chunks)} chunks breaks the output schema: "
                + "; ".join(e.message for e in errors),
                code="reduced_output_invalid",
            )
        log.info("task %s: input.%s answered in %d chunks", task.task_id, spec.slot, len(chunks))
        return merged

    def from_cache(self, prep: Prepared, output: dict[str, Any], model: str) -> Outcome:
        """A result answered without an LLM call (same input answered before): no cost."""
        return self._result(prep, output, model=model, usage=Usage(prompt_tokens=0,
                            completion_tokens=0), cost=0.0, attempts=0, cached=True)  # fmt: skip

    def _result(
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
    ) -> Outcome:
        latency_ms = (time.monotonic() - prep.started) * 1000
        result = Result(
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
        )
        value = orjson.dumps(result.model_dump(mode="json"))
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
            output=output,
            model=model,
            stages=stages,
            stage=prep.pipeline.stages[-1].name if prep.pipeline.stages else MAIN,
            review=tuple(prep.pipeline.review_reasons(prep.prompt.variables, output)),
        )
        if len(value) > self.room.result:
            too_large = OutputTooLarge(
                f"the result is {len(value)} bytes, over the {self.room.result} bytes the "
                "results topic takes (its max.message.bytes and the producer's limit)",
                code="result_too_large",
            )
            return self.failed(prep, too_large, outcome)
        return outcome

    def failed(self, prep: Prepared, exc: StreamsError, like: Outcome) -> Outcome:
        """A dead letter for a task whose outcome `like` cannot be written as it is; the
        tokens and cost it spent stay on it (they were counted when spent)."""
        letter = DeadLetter(
            task_id=prep.task.task_id,
            error=error_info(exc.category, exc.code, exc.message, exc.retryable),
            attempts=like.attempts,
            payload=payload_of(prep.raw),
            source=prep.source,
            failed_at=now_iso(),
        )
        return Outcome(
            kind="dead_letter",
            key=prep.task.task_id,
            value=dead_letter_value(letter, prep.raw, self.room.dead_letter),
            task_id=prep.task.task_id,
            category=exc.category.value,
            latency_ms=like.latency_ms,
            attempts=like.attempts,
            prompt_tokens=like.prompt_tokens,
            completion_tokens=like.completion_tokens,
            cost_usd=like.cost_usd,
        )

    async def _call(
        self,
        pipeline: Pipeline,
        version: PipelineVersion,
        prompt: RenderedPrompt,
        attempts: Attempts,
        spend: _Spend,
        lane: Lane,
        deadline_at: float,
    ) -> dict[str, Any]:
        """The primary model with retries, then each fallback on the configured categories."""
        candidates: list[tuple[GuardedClient, RenderedPrompt]] = [(self.client, prompt)]
        for fb in version.spec.fallbacks:
            candidates.append((self.fallback_client(fb), replace(prompt, model=fb.model)))

        def attempt_on(
            client: GuardedClient, candidate: RenderedPrompt, wait: bool
        ) -> Callable[[Attempts], Awaitable[dict[str, Any]]]:
            async def run(a: Attempts) -> dict[str, Any]:
                return await self._attempt(
                    pipeline, candidate, a, spend, lane, deadline_at, client, wait_for_circuit=wait
                )

            return run

        for i, (client, candidate) in enumerate(candidates):
            has_next = i + 1 < len(candidates)
            try:
                # With a fallback ready, an open circuit moves on at once instead of waiting.
                return await call_with_retries(
                    attempt_on(client, candidate, not has_next), self.policy, attempts
                )
            except TaskError as exc:
                if not has_next or exc.category.value not in version.spec.fallback_on:
                    raise
                log.warning("%s failed with %s; falling back to %s", candidate.model,
                            exc.category.value, candidates[i + 1][1].model)  # fmt: skip
                attempts.previous = attempts.count
                attempts.last_error = None
        raise AssertionError("unreachable")  # pragma: no cover

    def _shorten(
        self,
        pipeline: Pipeline,
        version: PipelineVersion,
        task: Task,
        prompt: RenderedPrompt,
        exc: ContextOverflow,
    ) -> RenderedPrompt:
        """The prompt with the policy's slot cut to fit the context window, or `exc`."""
        policy = version.spec.on_context_overflow
        if policy is None:
            raise exc
        window_match = _WINDOW_RE.search(exc.message)
        window = int(window_match.group(1)) if window_match else self.context_window
        params = prompt.params
        budget = int(
            params.get("max_completion_tokens") or params.get("max_tokens") or DEFAULT_MAX_TOKENS
        )
        asked = _REQUESTED_RE.search(exc.message)
        prompt_tokens = int(asked.group(1)) if asked else count_messages(prompt.messages)
        text = str(prompt.variables.get(policy.slot) or "")
        text_tokens = counter()(text)
        # Cut the excess plus a margin for tokenizer differences; at least a quarter when
        # the provider's numbers say it fits (they count differently from us).
        excess = max(prompt_tokens + budget - window, text_tokens // 4)
        keep = text_tokens - excess - (32 + window // 100)
        if keep < 1:
            raise ContextOverflow(
                f"{exc.message} (truncating input.{policy.slot} cannot make it fit)",
                code="context_overflow_unmitigated",
            ) from exc
        shortened = truncate_tokens(text, keep, keep=policy.keep)
        log.warning(
            "task %s: prompt over the %d-token window; input.%s cut from %d to %d tokens",
            task.task_id, window, policy.slot, text_tokens, keep,
        )  # fmt: skip
        if self.metrics is not None:
            self.metrics.mitigations.labels(pipeline.name, "truncate").inc()
        task_input = {**task.input, policy.slot: shortened}
        return replace(version.render(task_input, self.default_model), model=prompt.model)

    def fallback_client(self, fallback: Fallback) -> GuardedClient:
        if self.clients is None:
            raise BadRequest("fallback models need a client pool", code="no_client_pool")
        return self.clients(fallback.model, fallback.base_url, fallback.api_key_env)

    async def _attempt(
        self,
        pipeline: Pipeline,
        prompt: RenderedPrompt,
        attempts: Attempts,
        spend: _Spend,
        lane: Lane,
        deadline_at: float,
        client: GuardedClient | None = None,
        *,
        wait_for_circuit: bool = True,
    ) -> dict[str, Any]:
        messages = list(prompt.messages)
        params = prompt.params
        last = attempts.last_error
        if last is not None and self.metrics is not None:
            self.metrics.retries.labels(last.category.value).inc()
        if isinstance(last, InvalidOutput) and last.code == "truncated":
            # Cut at max_tokens: the same prompt with 1.5x the budget, within the window.
            budget = int(params.get("max_tokens") or spend.completion_tokens or 256)
            room = self.context_window - spend.last_prompt_tokens
            params = {**params, "max_tokens": max(1, min(int(budget * 1.5), room))}
        repair = isinstance(last, InvalidOutput) and last.code != "truncated" and bool(spend.calls)
        try:
            if repair and last is not None:
                # One repair: show the model its answer and what was wrong with it.
                messages += [
                    {"role": "assistant", "content": spend.calls[-1]},
                    {
                        "role": "user",
                        "content": f"That answer was rejected: {last.message}. "
                        "Reply with one corrected JSON object only.",
                    },
                ]
                self._check_repair_cap(pipeline, messages, params, spend, last)
            params = self._fit_window(messages, params, prompt.params)
        except (OutputRejected, ContextOverflow):
            attempts.count -= 1  # refused before any call
            raise
        request = LLMRequest(
            messages=messages,
            model=prompt.model,
            params=params,
            response_format=prompt.response_format,
        )
        with TRACER.start_as_current_span(
            f"chat {prompt.model}",
            kind=SpanKind.CLIENT,
            attributes={
                "gen_ai.operation.name": "chat",
                "gen_ai.system": "openai",
                "gen_ai.request.model": prompt.model,
                "gen_ai.request.max_tokens": int(params.get("max_tokens") or 0),
                "llm_streams.attempt": attempts.count,
                "llm_streams.lane": lane.name.lower(),
            },
            record_exception=False,
        ) as span:
            try:
                response = await self._send(
                    request, spend, attempts, lane, deadline_at, client, wait_for_circuit
                )
            except CircuitOpen:
                attempts.count -= 1  # refused locally: no call was made
                mark_error(span, CircuitOpen("circuit open"))
                raise
            except StreamsError as exc:
                mark_error(span, exc)
                raise
            span.set_attributes({
                "gen_ai.response.model": response.model,
                "gen_ai.usage.input_tokens": response.prompt_tokens,
                "gen_ai.usage.output_tokens": response.completion_tokens,
            })  # fmt: skip
            spend.last_prompt_tokens = response.prompt_tokens
            spend.prompt_tokens += response.prompt_tokens
            spend.completion_tokens += response.completion_tokens
            spend.model = response.model
            spend.calls.append(response.content)
            if repair:
                spend.repair_tokens += response.prompt_tokens + response.completion_tokens
            try:
                output = parse_output(response, pipeline, prompt.variables)
            except InvalidOutput as exc:
                self._count_output(response.model, ok=False)
                mark_error(span, exc)
                raise
            self._count_output(response.model, ok=True)
            return output

    def _check_repair_cap(
        self,
        pipeline: Pipeline,
        messages: list[dict[str, str]],
        params: dict[str, Any],
        spend: _Spend,
        last: StreamsError,
    ) -> None:
        """Refuse a repair that could take the task past its pipeline's repair token cap."""
        cap = pipeline.spec.repair_token_cap
        budget = int(
            params.get("max_completion_tokens") or params.get("max_tokens") or DEFAULT_MAX_TOKENS
        )
        estimate = count_messages(messages) + budget
        if spend.repair_tokens + estimate > cap:
            raise OutputRejected(
                f"{last.message} (not repaired: a repair may take {estimate} tokens, "
                f"{spend.repair_tokens} spent on repairs already, cap {cap})",
                code="repair_token_cap",
            )

    def _fit_window(
        self, messages: list[dict[str, str]], params: dict[str, Any], configured: dict[str, Any]
    ) -> dict[str, Any]:
        """The params with the answer's budget cut to what the context window leaves
        (85% of it, minus the prompt), or ContextOverflow when that is under the floor:
        the pipeline's own budget, at most MIN_COMPLETION_TOKENS."""
        key = "max_completion_tokens" if "max_completion_tokens" in params else "max_tokens"
        want = int(params.get(key) or DEFAULT_MAX_TOKENS)
        usable = int(self.context_window * WINDOW_SHARE)
        # UTF-8 bytes bound the tokens from above: counting is needed only near the edge.
        if sum(len(m["content"].encode()) + 8 for m in messages) + want <= usable:
            return params
        prompt_tokens = count_messages(messages)
        room = usable - prompt_tokens
        floor = min(int(configured.get(key) or DEFAULT_MAX_TOKENS), MIN_COMPLETION_TOKENS)
        if room < floor:
            raise ContextOverflow(
                f"prompt of {prompt_tokens} tokens leaves {room} of the model's "
                f"{self.context_window}-token window ({WINDOW_SHARE:.0%} usable) for the "
                f"answer, under the floor of {floor}",
                code="context_overflow",
            )
        return params if room >= want else {**params, key: room}

    async def _send(
        self,
        request: LLMRequest,
        spend: _Spend,
        attempts: Attempts,
        lane: Lane,
        deadline_at: float,
        client: GuardedClient | None,
        wait_for_circuit: bool,
    ) -> LLMResponse:
        """One attempt's request: a call (flex tier: at the flex price, falling back to a
        plain call when flex has no capacity), or a line in a batch (batch tier)."""
        if spend.tier == "batch" and spend.route is not None and self.batches is not None:
            partition, custom_id = spend.route
            response = await self.batches.complete(partition, custom_id, attempts.count, request)
            spend.discounted_prompt += response.prompt_tokens
            spend.discounted_completion += response.completion_tokens
            if self.metrics is not None:
                self.metrics.llm_requests.labels(request.model, "ok", "").inc()
                self.metrics.tokens.labels(response.model, "prompt").inc(response.prompt_tokens)
                self.metrics.tokens.labels(response.model, "completion").inc(
                    response.completion_tokens
                )
            return response
        guarded = client or self.client
        if spend.tier == "flex":
            flex = replace(request, params={**request.params, "service_tier": "flex"})
            try:
                response = await guarded.complete(
                    flex, lane=lane, deadline_at=deadline_at, wait_for_circuit=wait_for_circuit
                )
            except RateLimited as exc:
                if exc.code not in CAPACITY_CODES:
                    raise
                log.info("flex tier has no capacity (%s); this task goes on at the sync price",
                         exc.code)  # fmt: skip
                spend.tier = "sync"
                if self.metrics is not None:
                    self.metrics.mitigations.labels("*", "flex_fallback").inc()
                raise
            spend.discounted_prompt += response.prompt_tokens
            spend.discounted_completion += response.completion_tokens
            return response
        return await guarded.complete(
            request, lane=lane, deadline_at=deadline_at, wait_for_circuit=wait_for_circuit
        )

    def _count_output(self, model: str, *, ok: bool) -> None:
        if self.metrics is not None:
            self.metrics.outputs.labels(model, "pass" if ok else "fail").inc()

    def _cost(self, spend: _Spend) -> float:
        """USD for the tokens spent: the price table, the batch price for batch/flex calls."""
        full = self.prices.cost(spend.prompt_tokens, spend.completion_tokens)
        discounted = self.prices.cost(spend.discounted_prompt, spend.discounted_completion)
        return round(full - discounted * (1 - self.tier_price_ratio), 8)

    def _count_cost(self, pipeline: str, spend: _Spend, cost: float) -> None:
        if self.metrics is not None and cost > 0:
            model = spend.model or self.default_model
            self.metrics.cost.labels(pipeline, model, spend.tier).inc(cost)

    def _dead(
        self,
        exc: StreamsError,
        raw: bytes | None,
        key: bytes | None,
        task: Task | None,
        source: Source,
        attempts: Attempts,
        spend: _Spend,
        started: float,
    ) -> Outcome:
        task_id = task.task_id if task else task_id_hint(raw, key)
        letter = DeadLetter(
            task_id=task_id,
            error=error_info(exc.category, exc.code, exc.message, exc.retryable),
            attempts=attempts.count,
            payload=payload_of(raw),
            source=source,
            failed_at=now_iso(),
        )
        dl_key = task_id or f"{source.topic}/{source.partition}/{source.offset}"
        cost = self._cost(spend)
        if task is not None:
            self._count_cost(task.pipeline, spend, cost)
        return Outcome(
            kind="dead_letter",
            key=dl_key,
            value=dead_letter_value(letter, raw, self.room.dead_letter),
            task_id=task_id,
            category=exc.category.value,
            latency_ms=(time.monotonic() - started) * 1000,
            attempts=attempts.count,
            prompt_tokens=spend.prompt_tokens,
            completion_tokens=spend.completion_tokens,
            cost_usd=cost,
        )


__all__ = ["Outcome", "Prepared", "Prices", "TaskProcessor"]
