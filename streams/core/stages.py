"""Stages after the first: each a pipeline run on the answers before it.

A stage runs when its `when` holds, on an input built from the task's slots
and the earlier answers, with the same retries, limiter, breaker and task
deadline as the first call. Answers already known (kept in the task state by
an earlier run that failed later on) are not asked again, so a failed stage
resumes from itself.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from streams.errors import Category, Permanent, TaskError
from streams.observability.tracing import stage_span
from streams.pipelines.jinja import over_record
from streams.pipelines.pipeline import Pipeline, Stage
from streams.pipelines.render import PipelineVersion, RenderedPrompt

MAIN = "main"  # the first stage's name in task states

Call = Callable[[Pipeline, PipelineVersion, RenderedPrompt], Awaitable[dict[str, Any]]]


class StageInputError(Permanent):
    """A stage's `when` or input cannot be evaluated on the answers before it."""

    category = Category.INVALID_OUTPUT


class StageFailed(TaskError):
    """A stage after the first failed; its category and code are its cause's."""

    def __init__(self, stage: str, cause: TaskError) -> None:
        super().__init__(f"stage {stage}: {cause.message}", code=cause.code)
        self.stage = stage
        self.category = cause.category
        self.retryable = cause.retryable


async def run_stages(
    stages: list[Stage],
    *,
    variables: dict[str, Any],
    output: dict[str, Any],
    done: dict[str, Any],
    task_id: str,
    default_model: str,
    call: Call,
) -> dict[str, Any]:
    """Answers of the stages by name (None: skipped). `done` holds answers known
    before (not asked again) and receives each new one as soon as it is there."""
    answers: dict[str, Any] = {}
    context: dict[str, Any] = {"input": variables, "output": output, "stages": answers}
    for stage in stages:
        if stage.name in done:
            answers[stage.name] = done[stage.name]
            continue
        try:
            with over_record("cannot evaluate its when/input", "stage_input", StageInputError):
                applies = stage.applies(context)
                stage_input = stage.build_input(context) if applies else None
        except StageInputError as exc:
            raise StageFailed(stage.name, exc) from exc
        if stage_input is None:
            answers[stage.name] = done[stage.name] = None
            continue
        version = stage.pipeline.version(stage.version, task_id)
        try:
            prompt = version.render(stage_input, default_model)
            with stage_span(stage.name, stage.pipeline.name, version.version):
                answer = await call(stage.pipeline, version, prompt)
        except TaskError as exc:
            raise StageFailed(stage.name, exc) from exc
        answers[stage.name] = done[stage.name] = answer
    return answers


__all__ = ["MAIN", "StageFailed", "StageInputError", "run_stages"]
