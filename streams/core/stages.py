"""Stages after the first: each a pipeline run on the answers before it.

A stage runs when its `when` holds, on an input built from the task's slots
and the earlier answers, with the same retries, limiter, breaker and task
deadline as the first call. Answers already known (kept in the task state by
an earlier run that failed later on) are not asked again, so a failed stage
resumes from itself — those whose definitions are still the ones they were made
under (`still_made_of`): a stage's pipeline edited in place since is asked again.
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


def definitions(pipeline: Pipeline, version: PipelineVersion) -> dict[str, str]:
    """What each stage's answer is made of now, by stage name, in order (MAIN: the
    version's own answer's)."""
    return {MAIN: version.own_digest, **{s.name: s.digest for s in pipeline.stages}}


def still_made_of(
    answers: dict[str, Any], made_under: dict[str, str] | None, now: dict[str, str]
) -> dict[str, Any]:
    """Of the answers an earlier run got (`made_under`: each one's definition then), those
    to use again: the first stages', up to the first whose definition is another now or
    that was not answered (a stage after a changed one is asked again: its input may be
    another). An earlier run of a release that kept no definitions: all of them."""
    if made_under is None:
        return dict(answers)
    kept: dict[str, Any] = {}
    for name, digest in now.items():
        if name not in answers or made_under.get(name) != digest:
            break
        kept[name] = answers[name]
    return kept


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


__all__ = ["MAIN", "StageFailed", "StageInputError", "definitions", "run_stages", "still_made_of"]
