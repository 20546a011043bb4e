"""Load `pipelines/*.yaml`, check slots, render prompts in a sandboxed Jinja2 environment."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import jsonschema
import jsonschema_rs
import yaml
from jinja2 import TemplateError, Undefined
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from streams.errors import ConfigError, InvalidInput
from streams.llm.client import SCHEMA_IN_PROMPT, budget_key
from streams.pipelines.defaults import has_defaults
from streams.pipelines.jinja import ENV, over_record
from streams.pipelines.sources import SourceMapper, SourceSpec
from streams.preprocess import Redactor, clean

# How a chunked input's per-chunk answers merge, per output field (streams.core.chunking).
REDUCERS = (
    "vote", "majority", "mean", "min", "max", "union", "first", "last", "longest", "join",
    "any", "all",
)  # fmt: skip

_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "object": dict,
    "array": list,
}


class Slot(BaseModel):
    """A typed template variable taken from the task's `input`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["string", "integer", "number", "boolean", "object", "array"] = "string"
    required: bool = True
    default: Any = None
    enum: list[Any] | None = None
    max_length: int | None = Field(None, ge=1)


FallbackCategory = Literal[
    "circuit_open", "upstream_error", "timeout", "rate_limited", "invalid_output"
]


def _default_fallback_on() -> list[FallbackCategory]:
    return ["circuit_open", "upstream_error", "timeout"]


class Fallback(BaseModel):
    """A model (on the same or another OpenAI-compatible endpoint) to try next."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1)
    base_url: str | None = None
    api_key_env: str | None = Field(None, description="Variable holding that endpoint's key.")


class OverflowPolicy(BaseModel):
    """What to do when a prompt does not fit the model's context window."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    strategy: Literal["truncate"] = Field(
        description="truncate: cut the slot's text to fit, then retry once."
    )
    slot: str = Field(min_length=1, description="The string slot to shorten.")
    keep: Literal["head", "tail"] = "head"


class SessionKeep(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    slots: list[str] | None = Field(
        None, description="The user's slots a turn keeps (none given: every slot)."
    )
    fields: list[str] = Field(
        default_factory=list, description="The answer's fields a turn keeps (empty: all)."
    )


class SessionSpec(BaseModel):
    """Multi-turn context (`core.sessions`): the earlier turns of a task's session go into
    its prompt, within `budget_tokens`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str = Field(
        "session_id",
        description="Where a task's session id is: `session_id` (the task's field), "
        "`input.<slot>` or `metadata.<name>`.",
    )
    budget_tokens: int = Field(1000, ge=1, description="Tokens the earlier turns may take.")
    keep: SessionKeep = Field(default_factory=SessionKeep)
    mark: list[str] = Field(
        default_factory=lambda: ["intent", "slots"],
        description="Answer fields that, filled, mark a turn as carrying intent or filled "
        "slots: kept before other earlier turns.",
    )
    max_turns: int = Field(50, ge=1, le=1000, description="Turns stored per session.")

    @field_validator("key")
    @classmethod
    def _key_is_a_place(cls, key: str) -> str:
        if key != "session_id" and not re.fullmatch(r"(input|metadata)\.[A-Za-z0-9_-]+", key):
            raise ValueError(f"session.key {key!r}: give session_id, input.<slot> or "
                             "metadata.<name>")  # fmt: skip
        return key

    def session_of(self, task: Any) -> str | None:
        """The session id of a task (a `Task`, or a record's decoded JSON), or None (a
        task outside any session)."""

        def part(name: str) -> Any:
            return task.get(name) if isinstance(task, dict) else getattr(task, name, None)

        if self.key == "session_id":
            value = part("session_id")
        else:
            where, _, name = self.key.partition(".")
            found = part(where)
            value = found.get(name) if isinstance(found, dict) else None
        return None if value in (None, "") else str(value)


class VersionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    system: str
    template: str
    slots: dict[str, Slot] = Field(min_length=1)
    model: str | None = None
    fallbacks: list[Fallback] = Field(default_factory=list)
    fallback_on: list[FallbackCategory] = Field(default_factory=_default_fallback_on)
    params: dict[str, Any] = Field(default_factory=dict)
    # How the answer's structure is asked for: `json_schema` (strict structured output),
    # `json_object` (JSON mode; the prompt describes the shape), `schema_in_prompt`
    # (JSON mode, the output schema appended to the system message), `tool_call` (a
    # forced function call whose parameters are the output schema) — the last two for
    # endpoints that ignore `response_format` json_schema. The answer is validated
    # against the output schema whatever the mode.
    response_format: Literal["json_schema", "json_object", "schema_in_prompt", "tool_call"] = (
        "json_schema"
    )
    example_input: dict[str, Any] | None = None
    on_context_overflow: OverflowPolicy | None = None
    session: SessionSpec | None = None

    @model_validator(mode="after")
    def _params_make_sense(self) -> VersionSpec:
        """Refuse sampling settings that are out of range or work against each other."""
        p = self.params
        temperature, top_p, max_tokens = p.get("temperature"), p.get("top_p"), p.get(budget_key(p))
        if temperature is not None and not 0 <= temperature <= 2:
            raise ValueError(f"params.temperature {temperature} is outside 0..2")
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"params.top_p {top_p} is outside (0, 1]")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(f"params.max_tokens {max_tokens!r} must be a positive integer")
        if (temperature or 0) > 0.8 and max_tokens is not None and max_tokens < 50:
            raise ValueError(
                f"params: temperature {temperature} with max_tokens {max_tokens} contradict "
                "each other (wide sampling, too little room for a JSON answer); lower the "
                "temperature or raise max_tokens"
            )
        return self

    def warnings(self) -> list[str]:
        """Allowed, but worth a second look."""
        p = self.params
        found = []
        if p.get("temperature", 0) > 0 and p.get("top_p", 1) < 1:
            found.append("both temperature and top_p change sampling; tune one of them")
        if p.get("temperature", 0) > 1.2:
            found.append(f"temperature {p['temperature']} makes JSON answers fail validation often")
        return found

    @model_validator(mode="after")
    def _session_slots_exist(self) -> VersionSpec:
        kept = self.session.keep.slots if self.session is not None else None
        unknown = sorted(set(kept or []) - set(self.slots))
        if unknown:
            raise ValueError(f"session.keep.slots {unknown} are not slots of this version")
        return self

    @model_validator(mode="after")
    def _overflow_slot_is_text(self) -> VersionSpec:
        policy = self.on_context_overflow
        if policy is not None:
            slot = self.slots.get(policy.slot)
            if slot is None or slot.type != "string":
                raise ValueError(f"on_context_overflow.slot {policy.slot!r} is not a string slot")
        return self


class StageSpec(BaseModel):
    """A follow-up stage: another pipeline run on this one's answer.

    `when` and each `input` value are Jinja expressions over `input` (this task's
    slots, cleaned and redacted), `output` (the first stage's answer) and
    `stages` (answers of the stages before, by name; null when skipped).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[a-z][a-z0-9_-]*$")
    pipeline: str = Field(min_length=1)
    version: str | None = None
    when: str | None = None
    input: dict[str, str] = Field(min_length=1)


class ChunkingSpec(BaseModel):
    """Inputs whose `slot` is over the budget are split, each chunk answered on its own,
    and the answers merged field by field (see streams.core.chunking). A pipeline
    without it dead-letters such inputs as context_overflow (or truncates them, when a
    version says `on_context_overflow: truncate`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    slot: str = Field(min_length=1, description="The string slot to split.")
    max_tokens: int | None = Field(
        None,
        ge=32,
        description="Tokens of the slot's text per chunk; default: what the model's context "
        "window leaves (85%) after the prompt around it and the answer's budget.",
    )
    overlap_tokens: int = Field(64, ge=0, description="Whole sentences repeated across a cut.")
    max_chunks: int = Field(16, ge=2, description="More than this: dead letter, not a bill.")
    parallel: int = Field(4, ge=1, le=32, description="Chunks of one task asked at once.")
    weight_field: str | None = Field(
        "confidence", description="Numeric output field weighting `vote` (1 when absent)."
    )
    reduce: dict[str, str] = Field(
        default_factory=dict, description="Output field -> reducer (default: first)."
    )

    @model_validator(mode="after")
    def _known_reducers(self) -> ChunkingSpec:
        unknown = {f: r for f, r in self.reduce.items() if r not in REDUCERS}
        if unknown:
            raise ValueError(f"chunking.reduce: unknown reducers {unknown} (known: {REDUCERS})")
        if self.max_tokens is not None and self.overlap_tokens >= self.max_tokens // 2:
            raise ValueError("chunking.overlap_tokens must be under half of max_tokens")
        return self


class PackingSpec(BaseModel):
    """Short records answered several to a request (see streams.core.packing)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    slot: str = Field(min_length=1, description="The string slot measured against max_chars.")
    max_chars: int = Field(200, ge=1, description="Longer records are answered alone.")
    max_items: int = Field(20, ge=2, le=100, description="Tasks per request at most.")
    linger_s: float = Field(
        0.02, ge=0, le=2, description="How long a task waits for others to fill its pack."
    )


class LanePolicy(BaseModel):
    """How each lane's calls are made and priced: sync (a call), flex (a call at the batch
    price with slower answers, a plain call when flex has no capacity), batch (the
    provider's Batch API: half price, answers within 24 h; replay lane only)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    live: Literal["sync", "flex"] = "sync"
    replay: Literal["sync", "flex", "batch"] = "sync"

    def of(self, lane: str) -> str:
        return self.live if lane == "live" else self.replay


class ReviewSpec(BaseModel):
    """Results a person should look at: they also go to the review topic, with reasons."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    confidence_below: float | None = Field(None, ge=0, le=1)
    confidence_field: str = "confidence"
    rules: dict[str, str] = Field(
        default_factory=dict,
        description="name -> Jinja expression over `input` and `output`; true flags it.",
    )


PiiKind = Literal["email", "cn_id", "bank_card", "phone"]


class PreprocessSpec(BaseModel):
    """Cleaning and PII redaction of every string slot before rendering (all on by default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    clean: bool = True
    redact: list[PiiKind] = Field(default_factory=lambda: list(get_args(PiiKind)))
    extra_patterns: dict[str, str] = Field(
        default_factory=dict, description="name -> regex; matches become [NAME]."
    )

    @model_validator(mode="after")
    def _patterns_compile(self) -> PreprocessSpec:
        for name, pattern in self.extra_patterns.items():
            if not name.replace("_", "").isalnum():
                raise ValueError(f"extra_patterns: name {name!r} must be letters, digits, _")
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"extra_patterns.{name}: not a regex: {exc}") from None
        return self


class PipelineSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    description: str = ""
    default_version: str
    output_schema: str
    quote_fields: list[str] = Field(
        default_factory=list,
        description="Output paths `a[].b` whose strings must quote the `quote_source` slot.",
    )
    quote_source: str | None = None
    repair_token_cap: int = Field(
        4000,
        ge=0,
        description="Tokens (prompt + completion) one task may spend on repair attempts, "
        "which resend the rejected answer with the validator's message; 0 = never repair.",
    )
    preprocess: PreprocessSpec = Field(default_factory=PreprocessSpec)
    review: ReviewSpec | None = None
    chunking: ChunkingSpec | None = None
    packing: PackingSpec | None = None
    lanes: LanePolicy = Field(default_factory=LanePolicy)
    stages: list[StageSpec] = Field(
        default_factory=list,
        description="Stages after the first, in order; their answers land under output.stages.",
    )
    source: SourceSpec | None = Field(
        None,
        description="Existing topics read as they are, each record mapped to a task "
        "(streams.pipelines.sources); none: tasks come as record contract v1 envelopes.",
    )
    traffic: dict[str, float] | None = Field(
        None,
        description="A/B split: version -> weight. Tasks that pin no version are bucketed "
        "by a hash of their task_id, so a task always gets the same version.",
    )
    versions: dict[str, VersionSpec] = Field(min_length=1)

    def _string_slot(self, what: str, slot_name: str) -> None:
        for name, version in self.versions.items():
            slot = version.slots.get(slot_name)
            if slot is None or slot.type != "string":
                raise ValueError(f"{what}.slot {slot_name!r} is not a string slot of {name}")

    @model_validator(mode="after")
    def _one_session_key(self) -> PipelineSpec:
        keys = {v.session.key for v in self.versions.values() if v.session is not None}
        if len(keys) > 1:
            raise ValueError(f"versions find the session id in different places: {sorted(keys)}")
        return self

    @model_validator(mode="after")
    def _default_exists(self) -> PipelineSpec:
        if self.default_version not in self.versions:
            raise ValueError(f"default_version {self.default_version!r} is not in versions")
        if self.chunking is not None:
            self._string_slot("chunking", self.chunking.slot)
        if self.packing is not None:
            self._string_slot("packing", self.packing.slot)
            for name, version in self.versions.items():
                if re.search(r"</?\s*item\b", version.system + version.template, re.I):
                    raise ValueError(f"packing: {name}'s prompts use <item> tags, which packs use")
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names) or "main" in names:
            raise ValueError("stage names must be unique and not 'main'")
        if self.traffic is not None:
            unknown = set(self.traffic) - set(self.versions)
            if unknown:
                raise ValueError(f"traffic names versions {sorted(unknown)} not in versions")
            if any(w < 0 for w in self.traffic.values()) or sum(self.traffic.values()) <= 0:
                raise ValueError("traffic weights must be >= 0 with a positive sum")
        return self


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


def structured_output(
    mode: str, name: str, schema: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any] | None, str]:
    """How a request asks for an answer of `schema`: (response_format, tool, text for the
    end of the system message) for a version's `response_format` mode."""
    name = name.replace("-", "_")
    if mode == "json_schema":
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": strict_view(schema),
                                                      "strict": True}}  # fmt: skip
        return fmt, None, ""
    if mode == "tool_call":
        tool = {"name": name, "description": "Give the answer.",
                "parameters": strict_view(schema), "strict": True}  # fmt: skip
        return {}, tool, ""
    if mode == "schema_in_prompt":
        text = f"\n\n{SCHEMA_IN_PROMPT}\n{json.dumps(schema, sort_keys=True)}"
        return {"type": "json_object"}, None, text
    return {"type": "json_object"}, None, ""


# What OpenAI's strict structured outputs take of JSON Schema (its documented subset).
STRICT_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "enum", "const",
    "anyOf", "$ref", "$defs", "definitions", "description", "title", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minItems",
    "maxItems", "$schema", "$id",
})  # fmt: skip


# Keywords whose values are maps of names to schemas, lists of schemas, or a schema.
_NAMED, _LISTED, _NESTED = ("properties", "$defs", "definitions"), ("anyOf",), ("items",)


def strict_view(schema: Any) -> Any:
    """The output schema as a strict-mode request carries it: the keywords outside OpenAI's
    strict subset (`minLength`, `uniqueItems`, ...) left out — a strict endpoint refuses
    them — while the answer is still checked against the whole schema here."""
    if not isinstance(schema, dict):
        return schema
    view: dict[str, Any] = {}
    for key, value in schema.items():
        if key not in STRICT_KEYWORDS:
            continue
        if key in _NAMED and isinstance(value, dict):
            view[key] = {name: strict_view(sub) for name, sub in value.items()}
        elif key in _LISTED and isinstance(value, list):
            view[key] = [strict_view(sub) for sub in value]
        elif key in _NESTED:
            view[key] = strict_view(value)
        else:
            view[key] = value
    return view


def strict_dropped(schema: Any, at: str = "#") -> list[str]:
    """Where the strict view leaves narrowing keywords out (checked here, not sent)."""
    if not isinstance(schema, dict):
        return []
    found = [f"{at}: `{k}`" for k in sorted(set(schema) & NARROWING)]
    for key in _NAMED:
        for name, sub in (schema.get(key) or {}).items():
            found += strict_dropped(sub, f"{at}/{key}/{name}")
    for i, sub in enumerate(schema.get("anyOf") or []):
        found += strict_dropped(sub, f"{at}/anyOf/{i}")
    if isinstance(schema.get("items"), dict):
        found += strict_dropped(schema["items"], f"{at}/items")
    return found


# Keywords outside the strict subset that only narrow what the subset allows: left out of
# the request, they cost the model a hint, not the answer's shape (checked here anyway).
NARROWING = frozenset({
    "minLength", "maxLength", "uniqueItems", "minProperties", "maxProperties", "default",
    "examples", "$comment", "readOnly", "writeOnly", "deprecated", "contentEncoding",
    "contentMediaType",
})  # fmt: skip


def strict_subset_issues(schema: Any, at: str = "#") -> list[str]:
    """Where an output schema cannot be asked for as it is in OpenAI's strict mode:
    keywords outside the subset that shape the answer (`oneOf`, `allOf`, `not`, ...:
    left out of the request, the model is not told them), objects without
    `additionalProperties: false` or with optional properties. Narrowing keywords
    (`maxLength`, `uniqueItems`, ...) are no issue: `strict_dropped` names them."""
    if not isinstance(schema, dict):
        return []
    found = [f"{at}: `{k}` is outside the strict-mode subset"
             for k in sorted(set(schema) - STRICT_KEYWORDS - NARROWING)]  # fmt: skip
    props = schema.get("properties")
    if schema.get("type") == "object" or isinstance(props, dict):
        if schema.get("additionalProperties") is not False:
            found.append(f"{at}: strict mode needs additionalProperties: false")
        optional = sorted(set(props or {}) - set(schema.get("required") or []))
        if optional:
            found.append(f"{at}: strict mode needs every property required ({optional})")
    for key in ("properties", "$defs", "definitions"):
        for name, sub in (schema.get(key) or {}).items():
            found += strict_subset_issues(sub, f"{at}/{key}/{name}")
    for i, sub in enumerate(schema.get("anyOf") or []):
        found += strict_subset_issues(sub, f"{at}/anyOf/{i}")
    if isinstance(schema.get("items"), dict):
        found += strict_subset_issues(schema["items"], f"{at}/items")
    return found


# Tags a template uses to delimit record text (`<comment>{{ text }}</comment>`).
_TAG = re.compile(r"</?\s*([A-Za-z][\w.-]*)\s*>")


def delimiter_guard(template: str) -> Callable[[str], str] | None:
    """What makes record text unable to close (or open) the template's delimiters: every
    `<tag`/`</tag` of a tag the template uses becomes `&lt;tag`/`&lt;/tag`; None when
    the template delimits nothing. Record text is data: it stays inside its tags."""
    names = sorted({m.group(1).lower() for m in _TAG.finditer(template)})
    if not names:
        return None
    pattern = re.compile(
        r"<(\s*/?\s*)(" + "|".join(re.escape(n) for n in names) + r")(?![\w.-])", re.IGNORECASE
    )
    return lambda text: pattern.sub(r"&lt;\1\2", text)


class PipelineVersion:
    """One prompt version: compiled templates plus model parameters."""

    def __init__(self, pipeline: Pipeline, version: str, spec: VersionSpec) -> None:
        self.pipeline = pipeline
        self.version = version
        self.spec = spec
        try:
            self._system = ENV.from_string(spec.system)
            self._user = ENV.from_string(spec.template)
            self._guard = delimiter_guard(spec.system + "\n" + spec.template)
        except TemplateError as exc:
            raise ConfigError(f"pipeline {pipeline.name} {version}: template error: {exc}") from exc

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
        expected = _JSON_TYPES[slot.type]
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
        response_format, tool, more = structured_output(
            self.spec.response_format, self.pipeline.name, self.pipeline.output_schema
        )
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

    def _originals(self, task_input: dict[str, Any]) -> dict[str, Any]:
        slot = self.pipeline.spec.quote_source
        return {slot: task_input[slot]} if slot and slot in task_input else {}


class Pipeline:
    """A named pipeline: versions, output schema and its compiled validator."""

    def __init__(self, spec: PipelineSpec, output_schema: dict[str, Any]) -> None:
        self.spec = spec
        self.name = spec.name
        self.output_schema = output_schema
        pre = spec.preprocess
        self.redactor = Redactor(pre.redact, pre.extra_patterns)
        # jsonschema (Python) is the reference and writes the error messages; the Rust
        # validator answers "is it valid?" ~100x faster on the hot path (0.6 us vs 107 us).
        self.validator = jsonschema.Draft202012Validator(output_schema)
        self.is_valid = jsonschema_rs.validator_for(output_schema).is_valid
        # Optional fields with a `default` are filled in every output (defaults shown).
        self.fills_defaults = has_defaults(output_schema)
        self.versions = {v: PipelineVersion(self, v, s) for v, s in spec.versions.items()}
        self.source = SourceMapper(spec.name, spec.source) if spec.source is not None else None
        self.stages: list[Stage] = []  # resolved by the registry once every pipeline loaded
        try:
            self._review_rules = {
                name: ENV.compile_expression(expr)
                for name, expr in (spec.review.rules if spec.review else {}).items()
            }
        except TemplateError as exc:
            raise ConfigError(f"pipeline {spec.name}: review rule: {exc}") from exc
        total = sum((spec.traffic or {}).values())
        self._split: list[tuple[float, str]] = []
        edge = 0.0
        for name, weight in sorted((spec.traffic or {}).items()):
            if weight > 0:
                edge += weight / total
                self._split.append((edge, name))

    def review_reasons(self, variables: dict[str, Any], output: dict[str, Any]) -> list[str]:
        """Why this answer needs a person (empty: it does not)."""
        review = self.spec.review
        if review is None:
            return []
        reasons = []
        confidence = output.get(review.confidence_field)
        if (
            review.confidence_below is not None
            and isinstance(confidence, int | float)
            and confidence < review.confidence_below
        ):
            reasons.append("low_confidence")
        for name, rule in self._review_rules.items():
            try:
                hit = bool(rule(input=variables, output=output))
            except Exception:  # whatever the answer leads it to: a rule that cannot
                hit = False  # judge this answer does not flag it
            if hit:
                reasons.append(name)
        return reasons

    @property
    def session(self) -> SessionSpec | None:
        """Where its tasks' session ids are (any version's `session:`; they agree)."""
        for v in self.spec.versions.values():
            if v.session is not None:
                return v.session
        return None

    def session_of(self, task: Any) -> str | None:
        """The task's session id when the pipeline keeps sessions, else None."""
        spec = self.session
        return spec.session_of(task) if spec is not None else None

    def bucket(self, task_id: str) -> str:
        """The version of the traffic split this id (a task's, or its session's, so a
        conversation keeps its version) falls in (stable across runs)."""
        digest = hashlib.sha256(f"{self.name}\x1f{task_id}".encode()).digest()
        point = int.from_bytes(digest[:8], "big") / 2**64
        for edge, name in self._split:
            if point < edge:
                return name
        return self._split[-1][1]

    def version(self, requested: str | None, task_id: str | None = None) -> PipelineVersion:
        """The version asked for; else, with a traffic split and a task id, the task's
        bucket; else the default."""
        name = (
            requested
            or (self.bucket(task_id) if task_id is not None and self._split else None)
            or self.spec.default_version
        )
        try:
            return self.versions[name]
        except KeyError:
            raise InvalidInput(
                f"pipeline {self.name!r} has no prompt version {name!r} "
                f"(known: {sorted(self.versions)})",
                code="unknown_version",
            ) from None


@dataclass(frozen=True)
class Stage:
    """A resolved stage: its pipeline, and its expressions compiled."""

    name: str
    pipeline: Pipeline
    version: str | None
    when: Callable[..., Any] | None
    inputs: dict[str, Callable[..., Any]]

    def applies(self, context: dict[str, Any]) -> bool:
        return self.when is None or bool(self.when(**context))

    def build_input(self, context: dict[str, Any]) -> dict[str, Any]:
        built = {}
        for slot, expression in self.inputs.items():
            value = expression(**context)
            built[slot] = None if isinstance(value, Undefined) else value
        return built


def _resolve_stages(pipeline: Pipeline, pipelines: dict[str, Pipeline]) -> None:
    stages = []
    for spec in pipeline.spec.stages:
        where = f"pipeline {pipeline.name} stage {spec.name}"
        target = pipelines.get(spec.pipeline)
        if target is None:
            raise ConfigError(f"{where}: unknown pipeline {spec.pipeline!r}")
        if target.spec.stages:
            raise ConfigError(f"{where}: pipeline {spec.pipeline!r} has stages itself")
        if spec.version is not None and spec.version not in target.versions:
            raise ConfigError(f"{where}: {spec.pipeline!r} has no version {spec.version!r}")
        try:
            when = ENV.compile_expression(spec.when) if spec.when else None
            inputs: dict[str, Callable[..., Any]] = {
                k: ENV.compile_expression(v) for k, v in spec.input.items()
            }
        except TemplateError as exc:
            raise ConfigError(f"{where}: expression error: {exc}") from exc
        stages.append(Stage(spec.name, target, spec.version, when, inputs))
    pipeline.stages = stages


class PipelineRegistry:
    """Every pipeline of a directory, loaded and checked once at start-up."""

    def __init__(self, pipelines: dict[str, Pipeline]) -> None:
        self.pipelines = pipelines

    @classmethod
    def load(cls, pipelines_dir: Path, schemas_dir: Path) -> PipelineRegistry:
        files = sorted(pipelines_dir.glob("*.yaml")) + sorted(pipelines_dir.glob("*.yml"))
        if not files:
            raise ConfigError(f"no pipeline files (*.yaml) in {pipelines_dir}")
        pipelines: dict[str, Pipeline] = {}
        for path in files:
            pipeline = _load_one(path, schemas_dir)
            if pipeline.name in pipelines:
                raise ConfigError(f"{path}: pipeline {pipeline.name!r} is defined twice")
            pipelines[pipeline.name] = pipeline
        for pipeline in pipelines.values():
            _resolve_stages(pipeline, pipelines)
        return cls(pipelines)

    def sources(self) -> dict[str, list[SourceMapper]]:
        """Source topic -> the mappings of the pipelines that read it."""
        found: dict[str, list[SourceMapper]] = {}
        for pipeline in self.pipelines.values():
            if pipeline.source is not None:
                for topic in pipeline.source.spec.topics:
                    found.setdefault(topic, []).append(pipeline.source)
        return found

    @property
    def keeps_sessions(self) -> bool:
        """Does any pipeline keep sessions?"""
        return any(p.session is not None for p in self.pipelines.values())

    def get(self, name: str) -> Pipeline:
        try:
            return self.pipelines[name]
        except KeyError:
            raise InvalidInput(
                f"unknown pipeline {name!r} (known: {sorted(self.pipelines)})",
                code="unknown_pipeline",
            ) from None


def _load_one(path: Path, schemas_dir: Path) -> Pipeline:
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        spec = PipelineSpec.model_validate(raw)
    except (yaml.YAMLError, ValidationError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    schema_path = schemas_dir / spec.output_schema
    try:
        schema = json.loads(schema_path.read_text(encoding="utf-8"))
        jsonschema.Draft202012Validator.check_schema(schema)
    except (OSError, ValueError, jsonschema.SchemaError) as exc:
        raise ConfigError(f"{path}: output schema {schema_path}: {exc}") from exc
    pipeline = Pipeline(spec, schema)
    if spec.chunking is not None:
        known = set(schema.get("properties") or {})
        unknown = sorted(set(spec.chunking.reduce) - known)
        if unknown:
            raise ConfigError(f"{path}: chunking.reduce names fields {unknown} not in the schema")
    for version in pipeline.versions.values():
        if spec.source is not None:
            required = {n for n, slot in version.spec.slots.items()
                        if slot.required and slot.default is None}  # fmt: skip
            missing = sorted(required - set(spec.source.slots))
            if missing:
                raise ConfigError(f"{path}: source.slots does not map the slots {missing} "
                                  f"that version {version.version} requires")  # fmt: skip
        if version.spec.example_input is not None:
            try:
                version.render(version.spec.example_input, "example-model")
            except InvalidInput as exc:
                raise ConfigError(f"{path}: {version.version} example_input: {exc}") from exc
    return pipeline
