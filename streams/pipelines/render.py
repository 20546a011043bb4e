"""A prompt version: its templates compiled, a task's slots bound (cleaned, redacted,
checked), its prompt rendered (`RenderedPrompt`) with the record's text kept inside
the template's delimiters."""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

import orjson
from jinja2 import TemplateError

from streams.errors import ConfigError, InvalidInput
from streams.pipelines.jinja import ENV, over_record
from streams.pipelines.specs import JSON_TYPES, PipelineSpec, Slot, VersionSpec
from streams.pipelines.structured import structured_output
from streams.preprocess import Redactor, clean


@dataclass(frozen=True)
class RenderedPrompt:
    messages: list[dict[str, str]]
    model: str
    params: dict[str, Any]
    response_format: dict[str, Any]  # empty: none sent
    variables: dict[str, Any]
    redactions: Counter[str] = field(default_factory=Counter)  # PII replaced, by kind
    tool: dict[str, Any] | None = None  # the function the answer must call (`tool_call`)
    # The quoted slot as the task gave it, before cleaning: evidence may quote either.
    originals: dict[str, Any] = field(default_factory=dict)


# Tags a template uses to delimit record text (`<comment>{{ text }}</comment>`).
_TAG = re.compile(r"</?\s*([A-Za-z][\w.-]*)\s*>")


def delimiter_guard(template: str) -> Callable[[str], str] | None:
    """What makes record text unable to close (or open) the template's delimiters: every
    `<tag`/`</tag` of a tag the template uses becomes `&lt;tag`/`&lt;/tag`; None when
    the template delimits nothing. Record text is data: it stays inside its tags."""
    names = sorted({m.group(1).lower() for m in _TAG.finditer(template)})
    if not names:
        return None
    # Possessive blanks: backtracked, a `<` and a long run of blanks and newlines (what
    # cleaning leaves of one) cost the square of the run, 5.6 s for 32 KB.
    pattern = re.compile(
        r"<(\s*+/?\s*+)(" + "|".join(re.escape(n) for n in names) + r")(?![\w.-])", re.IGNORECASE
    )
    return lambda text: pattern.sub(r"&lt;\1\2", text)


class Owner(Protocol):
    """What a version reads of its pipeline (`pipeline.Pipeline`): its name, spec, output
    schema and redactor, and its later stages' definitions."""

    name: str
    spec: PipelineSpec
    output_schema: dict[str, Any]
    redactor: Redactor

    @property
    def stage_digests(self) -> list[str]: ...


class PipelineVersion:
    """One prompt version: compiled templates plus model parameters."""

    def __init__(self, pipeline: Owner, version: str, spec: VersionSpec) -> None:
        self.pipeline = pipeline
        self.version = version
        self.spec = spec
        try:
            self._system = ENV.from_string(spec.system)
            self._user = ENV.from_string(spec.template)
            self._guard = delimiter_guard(spec.system + "\n" + spec.template)
        except TemplateError as exc:
            raise ConfigError(f"pipeline {pipeline.name} {version}: template error: {exc}") from exc

    @cached_property
    def own_digest(self) -> str:
        """What this version's own answer is made of, hashed: its system and user templates,
        slots, model, parameters, response format, session and overflow rules, and the
        pipeline's output schema and preprocessing (what the file sets, defaults left
        out: a default a later release adds does not change it)."""
        spec = self.spec.model_dump(
            mode="json", exclude_defaults=True,
            include={"system", "template", "slots", "model", "params", "response_format",
                     "session", "on_context_overflow"},
        )  # fmt: skip
        made_of = {
            "version": spec,
            "output_schema": self.pipeline.output_schema,
            "preprocess": self.pipeline.spec.preprocess.model_dump(mode="json",
                                                                   exclude_defaults=True),
        }  # fmt: skip
        return hashlib.blake2b(orjson.dumps(made_of, option=orjson.OPT_SORT_KEYS),
                               digest_size=8).hexdigest()  # fmt: skip

    @cached_property
    def digest(self) -> str:
        """What this version's results are made of: its own answer's definition and, in a
        pipeline with later stages, theirs (`pipeline.Stage.digest`: an edit to a stage's
        pipeline changes the results too). A version edited in place answers under a new
        digest (`Result.prompt_digest`). Read once the registry resolved the stages."""
        stages = self.pipeline.stage_digests
        if not stages:
            return self.own_digest
        return hashlib.blake2b(orjson.dumps([self.own_digest, *stages]),
                               digest_size=8).hexdigest()  # fmt: skip

    def made_otherwise(self, digest: str) -> bool:
        """Was an answer of this `prompt_digest` made under another definition than this
        version's now? One whose digest is the version's own in a pipeline with stages
        was made by a release whose digest left the stages out: what they were then is not
        known, and it is not said to be another."""
        if digest == self.digest:
            return False
        return not (self.pipeline.stage_digests and digest == self.own_digest)

    def bind(
        self, task_input: dict[str, Any], redactions: Counter[str] | None = None
    ) -> dict[str, Any]:
        """Check the input against the slots; return the template variables, strings
        cleaned and redacted (counted into `redactions`) as the pipeline says."""
        pre = self.pipeline.spec.preprocess
        redactor = self.pipeline.redactor
        counts = redactions if redactions is not None else Counter()
        variables: dict[str, Any] = {}
        for name, slot in self.spec.slots.items():
            if name not in task_input or task_input[name] is None:
                if slot.required:
                    raise InvalidInput(f"input.{name} is required", code="missing_slot")
                variables[name] = slot.default
                continue
            value = self._checked(name, slot, task_input[name], pre.clean)
            if isinstance(value, str):
                value = redactor.redact(value, counts)
                if self._guard is not None:
                    value = self._guard(value)
            variables[name] = value
        return variables

    @staticmethod
    def _checked(name: str, slot: Slot, value: Any, cleaning: bool) -> Any:
        """One slot's value checked against its spec (cleaned when the pipeline cleans)."""
        expected = JSON_TYPES[slot.type]
        if isinstance(value, bool) and slot.type in {"integer", "number"}:
            expected = ()
        if not isinstance(value, expected):
            raise InvalidInput(
                f"input.{name} must be {slot.type}, got {type(value).__name__}",
                code="slot_type",
            )
        if isinstance(value, str) and cleaning:
            value = clean(value)
        if slot.type == "string" and slot.required and not str(value).strip():
            raise InvalidInput(f"input.{name} is empty", code="empty_slot")
        if slot.enum is not None and value not in slot.enum:
            raise InvalidInput(f"input.{name} must be one of {slot.enum}", code="slot_enum")
        if (
            slot.max_length is not None
            and hasattr(value, "__len__")
            and len(value) > slot.max_length
        ):
            raise InvalidInput(
                f"input.{name} has length {len(value)}, over {slot.max_length}",
                code="slot_too_long",
            )
        return value

    def render(self, task_input: dict[str, Any], default_model: str) -> RenderedPrompt:
        redactions: Counter[str] = Counter()
        variables = self.bind(task_input, redactions)
        with over_record("prompt does not render", "render_error"):
            system = self._system.render(**variables).strip()
            user = self._user.render(**variables).strip()
        response_format, tool, more = self._structured
        return RenderedPrompt(
            messages=[{"role": "system", "content": system + more},
                      {"role": "user", "content": user}],
            model=self.spec.model or default_model,
            params=dict(self.spec.params),
            response_format=response_format,
            variables=variables,
            redactions=redactions,
            tool=tool,
            originals=self._originals(task_input),
        )  # fmt: skip

    @cached_property
    def _structured(self) -> tuple[dict[str, Any], dict[str, Any] | None, str]:
        """How this version asks for its structure: the same for every task (it walked the
        output schema for each), and never changed by a request."""
        return structured_output(
            self.spec.response_format, self.pipeline.name, self.pipeline.output_schema
        )

    def _originals(self, task_input: dict[str, Any]) -> dict[str, Any]:
        slot = self.pipeline.spec.quote_source
        return {slot: task_input[slot]} if slot and slot in task_input else {}
