"""A record read before anything is asked of the LLM: where it is routed (its task id,
its session), whether its home would refuse it, and the task it makes — decoded,
validated, its version chosen (by its session's bucket), its prompt rendered with its
session's earlier turns — or its dead letter."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import orjson

from streams.contract.records import Source, Task, decode_task, record_json, task_keys
from streams.core.outcome import Outcome, Outcomes, Prepared
from streams.core.sessions import NONE as NO_CONTEXT
from streams.core.sessions import context_of, turn_position, with_context
from streams.core.spend import Spend
from streams.errors import InternalError, NotOurs, TaskError
from streams.llm.tokens import count_messages
from streams.observability.metrics import Metrics
from streams.pipelines.registry import PipelineRegistry
from streams.resilience.retry import Attempts

log = logging.getLogger(__name__)


def _turn_tokens(messages: list[dict[str, str]]) -> int:
    """Tokens a turn's messages add to a prompt (no reply priming: the prompt has it)."""
    return count_messages(messages) - 3


class Intake:
    """Reads records for the processor; never raises for a bad one."""

    def __init__(
        self,
        registry: PipelineRegistry,
        outcomes: Outcomes,
        metrics: Metrics,
        *,
        default_model: str,
        max_task_bytes: int,
    ) -> None:
        self.registry = registry
        self.outcomes = outcomes
        self.metrics = metrics
        self.default_model = default_model
        self.max_task_bytes = max_task_bytes
        self.sessions = registry.keeps_sessions

    def route_of(self, raw: bytes | None) -> tuple[str, str] | None:
        """A record's task id and what it is routed by (its session, else its task id),
        read without validating it (a record is forwarded to its home before its prompt
        is made there); None when it is no task to route (its dead letter is written
        where it is)."""
        if raw is None:
            return None
        try:
            data = record_json(raw)
        except orjson.JSONDecodeError:
            return None
        task_id = data.get("task_id") if isinstance(data, dict) else None
        if not isinstance(task_id, str) or not task_id:
            return None
        pipeline = self.registry.pipelines.get(str(data.get("pipeline")))
        session = pipeline.session_of(data) if pipeline is not None and self.sessions else None
        return task_id, session or task_id

    def refusal(self, raw: bytes | None, key: bytes | None, source: Source) -> Outcome | None:
        """The dead letter of a record that would be refused at its home (not a task, an
        unknown pipeline or version, slots that do not fit), or None. Asked before a
        record is forwarded: bad input ends where its producer wrote it, as any other,
        not as a copy on another partition. The prompt is not made (its home makes it)."""
        task: Task | None = None
        try:
            task = decode_task(raw, max_bytes=self.max_task_bytes)
            pipeline = self.registry.get(task.pipeline)
            version = pipeline.version(task.prompt_version,
                                       pipeline.session_of(task) or task.task_id)  # fmt: skip
            version.bind(task.input)
        except TaskError as exc:
            return self.outcomes.dead(exc, raw, key, task, source, Attempts(), Spend(),
                                      time.monotonic())  # fmt: skip
        except Exception:  # its home's prepare says what it is (a bug: its dead letter)
            return None
        return None

    def session_hint(self, raw: bytes | None) -> str | None:
        """The session a record's task belongs to, read without validating it (to order
        a session's records one after another); None when it names none or is not a task."""
        if raw is None or not self.sessions:
            return None
        try:
            data = record_json(raw)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(data, dict):
            return None
        pipeline = self.registry.pipelines.get(str(data.get("pipeline")))
        return pipeline.session_of(data) if pipeline is not None else None

    def prepare(
        self,
        raw: bytes | None,
        key: bytes | None,
        source: Source,
        history: Callable[[str], bytes | None] | None = None,
        position: int | None = None,
    ) -> Prepared | Outcome:
        """Decode and render a record: a task ready to answer, or its dead letter.

        A task of a session gets its version by its session's bucket and, when its
        version keeps sessions and `history` (session id -> the stored turns) is given,
        the earlier turns before `position` (default: the record's offset) in its prompt."""
        started = time.monotonic()
        task: Task | None = None
        m = self.metrics
        try:
            task = decode_task(raw, max_bytes=self.max_task_bytes)
            pipeline = self.registry.get(task.pipeline)
            session = pipeline.session_of(task)
            version = pipeline.version(task.prompt_version, session or task.task_id)
            prompt = version.render(task.input, self.default_model)
            context = NO_CONTEXT
            at = source.offset if position is None else position
            spec = version.spec.session
            if session is not None and spec is not None and history is not None:
                turns = history(session)
                known = turn_position(turns, task.task_id)  # answered before: its place
                at = at if known is None else known
                context = context_of(turns, task.task_id, at, spec, _turn_tokens)
                prompt = replace(prompt, messages=with_context(prompt.messages, context))
            chosen_by = ("pinned" if task.prompt_version else
                         "split" if pipeline.spec.traffic else "default")  # fmt: skip
            m.versions_chosen.labels(pipeline.name, version.version, chosen_by).inc()
            for kind, n in prompt.redactions.items():
                m.redactions.labels(pipeline.name, kind).inc(n)
            keys = task_keys(pipeline.name, version.version, task.task_id, task.input,
                             context.digest)  # fmt: skip
            return Prepared(
                task=task,
                pipeline=pipeline,
                version=version,
                prompt=prompt,
                result_key=keys[0],
                content_key=keys[1],
                raw=raw,
                key=key,
                source=source,
                started=started,
                session=session,
                position=at,
                context=context,
            )  # fmt: skip
        except TaskError as exc:
            return self.outcomes.dead(exc, raw, key, task, source, Attempts(), Spend(), started)
        except NotOurs:
            raise  # its session's turns are not this worker's to read any more
        except Exception as exc:  # a bug must not stop the worker or lose the record
            log.exception("unexpected error preparing %s", source)
            err = InternalError(f"internal error: {exc!r}", code="internal_error")
            return self.outcomes.dead(err, raw, key, task, source, Attempts(), Spend(), started)


__all__ = ["Intake"]
