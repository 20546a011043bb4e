"""Chunked requests: an input over the token budget answered chunk by chunk (a few at
once), a chunk over a window learned since the plan cut again, and the answers merged
with the pipeline's reducers (`core.chunking` cuts and merges; this asks)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any

from streams.contract.lanes import Lane
from streams.core.calls import Calls
from streams.core.chunking import reduce_outputs
from streams.core.outcome import Prepared
from streams.core.spend import Spend
from streams.core.window import chunk_plan
from streams.errors import ContextOverflow, OutputRejected, TaskError
from streams.observability.metrics import Metrics
from streams.pipelines.render import RenderedPrompt
from streams.resilience.retry import Attempts

log = logging.getLogger(__name__)


class Chunks:
    """Answers inputs in chunks, through the task's calls (plain calls, whatever the tier)."""

    def __init__(self, calls: Calls, metrics: Metrics, default_model: str) -> None:
        self.calls = calls
        self.metrics = metrics
        self.default_model = default_model

    async def _one(
        self,
        prep: Prepared,
        prompt: RenderedPrompt,
        chunk: str,
        gate: asyncio.Semaphore,
        lane: Lane,
        deadline_at: float,
        depth: int = 0,
    ) -> tuple[list[dict[str, Any]] | TaskError, Attempts, Spend]:
        """One chunk's answers (one, or its parts'), or why it has none."""
        pipeline, version, task = prep.pipeline, prep.version, prep.task
        slot = pipeline.spec.chunking.slot if pipeline.spec.chunking else ""
        mine, used = Attempts(), Spend()  # chunks go as plain calls, whatever the tier
        async with gate:
            rendered = version.render({**task.input, slot: chunk}, self.default_model)
            rendered = replace(rendered, model=prompt.model)
            try:
                return [await self.calls.call(
                    pipeline, version, rendered, mine, used, lane, deadline_at
                )], mine, used  # fmt: skip
            except ContextOverflow as exc:
                overflow: TaskError = exc
            except TaskError as exc:
                return exc, mine, used
        # Over the window learned since the plan (the server counts more tokens per one
        # of ours than it seemed): this chunk in chunks of the window now known.
        smaller = chunk_plan(pipeline, rendered, self.calls.client.window.tokens())
        if depth >= 2 or smaller is None or len(smaller) < 2:
            return overflow, mine, used
        parts = await asyncio.gather(*(self._one(prep, prompt, part, gate, lane, deadline_at,
                                                   depth + 1) for part in smaller))  # fmt: skip
        outputs: list[dict[str, Any]] = []
        for _, theirs, spent in parts:  # every part's calls were paid, answered or not
            mine.count += theirs.count
            used.add(spent)
        for answer, _, _ in parts:
            if isinstance(answer, TaskError):
                return answer, mine, used
            outputs += answer
        return outputs, mine, used

    async def answer(
        self,
        prep: Prepared,
        prompt: RenderedPrompt,
        chunks: list[str],
        attempts: Attempts,
        spend: Spend,
        lane: Lane,
        deadline_at: float,
    ) -> dict[str, Any]:
        """Each chunk answered on its own (a few at once), the answers merged."""
        pipeline, task = prep.pipeline, prep.task
        spec = pipeline.spec.chunking
        assert spec is not None
        gate = asyncio.Semaphore(spec.parallel)
        answers = await asyncio.gather(
            *(self._one(prep, prompt, chunk, gate, lane, deadline_at) for chunk in chunks)
        )
        for _, mine, used in answers:
            attempts.count = attempts.previous + mine.count
            attempts.previous = attempts.count
            spend.add(used)
        self.metrics.mitigations.labels(pipeline.name, "chunk").inc()
        self.metrics.chunks.labels(pipeline.name).inc(len(chunks))
        for i, (answer, _, _) in enumerate(answers):
            if isinstance(answer, TaskError):
                attempts.last_error = answer
                answer.message = f"chunk {i + 1} of {len(chunks)}: {answer.message}"
                raise answer
        outputs = [output for answer, _, _ in answers if isinstance(answer, list)
                   for output in answer]  # fmt: skip
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


__all__ = ["Chunks"]
