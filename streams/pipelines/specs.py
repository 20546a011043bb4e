"""What a pipeline file says, as typed specs: slots, versions, fallbacks, sessions, stages,
chunking, packing, lanes, review, preprocessing (pydantic, unknown keys refused)."""

from __future__ import annotations

import re
from typing import Any, Literal, get_args

from pydantic import (
    BaseModel,
    Field,
    field_validator,
    model_validator,
)

from streams.contract.mistakes import WRITTEN
from streams.llm.client import budget_key
from streams.llm.params import params_problems
from streams.pipelines.sinks import SinkSpec
from streams.pipelines.sources import SourceSpec

# How a chunked input's per-chunk answers merge, per output field (streams.core.chunking).
REDUCERS = (
    "vote", "majority", "mean", "min", "max", "union", "first", "last", "longest", "join",
    "any", "all",
)  # fmt: skip

JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "object": dict,
    "array": list,
}


class Slot(BaseModel):
    """A typed template variable taken from the task's `input`."""

    model_config = WRITTEN

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

    model_config = WRITTEN

    model: str = Field(min_length=1)
    base_url: str | None = None
    api_key_env: str | None = Field(None, description="Variable holding that endpoint's key.")


class OverflowPolicy(BaseModel):
    """What to do when a prompt does not fit the model's context window."""

    model_config = WRITTEN

    strategy: Literal["truncate"] = Field(
        description="truncate: cut the slot's text to fit, then retry once."
    )
    slot: str = Field(min_length=1, description="The string slot to shorten.")
    keep: Literal["head", "tail"] = "head"


class SessionKeep(BaseModel):
    model_config = WRITTEN

    slots: list[str] | None = Field(
        None, description="The user's slots a turn keeps (none given: every slot)."
    )
    fields: list[str] = Field(
        default_factory=list, description="The answer's fields a turn keeps (empty: all)."
    )


class SessionSpec(BaseModel):
    """Multi-turn context (`core.sessions`): the earlier turns of a task's session go into
    its prompt, within `budget_tokens`."""

    model_config = WRITTEN

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


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(params: dict[str, Any], name: str) -> float | None:
    """A sampling parameter that must be a number: None when unset; a ValueError when it
    is another kind of value (`temperature: "0.2"` quoted in YAML, `true`), said with the
    field, not a comparison's TypeError from deep in the load."""
    value = params.get(name)
    if value is None or _integer(value) or isinstance(value, float):
        return value
    raise ValueError(f"params.{name} {value!r} must be a number")


class VersionSpec(BaseModel):
    model_config = WRITTEN

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
        problems = params_problems(p)
        if problems:
            raise ValueError("\n".join(problems))  # a line each (contract.mistakes)
        temperature, top_p = _number(p, "temperature"), _number(p, "top_p")
        if temperature is not None and not 0 <= temperature <= 2:
            raise ValueError(f"params.temperature {temperature} is outside 0..2")
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"params.top_p {top_p} is outside (0, 1]")
        for name in ("max_tokens", "max_completion_tokens"):
            value = p.get(name)
            if value is not None and (not _integer(value) or value < 1):
                raise ValueError(f"params.{name} {value!r} must be a positive integer")
        max_tokens = p.get(budget_key(p))
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
        temperature, top_p = _number(p, "temperature") or 0, _number(p, "top_p")
        found = []
        if temperature > 0 and top_p is not None and top_p < 1:
            found.append("both temperature and top_p change sampling; tune one of them")
        if temperature > 1.2:
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

    model_config = WRITTEN

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

    model_config = WRITTEN

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

    model_config = WRITTEN

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

    model_config = WRITTEN

    live: Literal["sync", "flex"] = "sync"
    replay: Literal["sync", "flex", "batch"] = "sync"

    def of(self, lane: str) -> str:
        return self.live if lane == "live" else self.replay


class Caps(BaseModel):
    """Spend caps in USD: per clock hour and per UTC day (either, both, or none)."""

    model_config = WRITTEN

    usd_per_hour: float | None = Field(None, gt=0, description="Spend cap per clock hour.")
    usd_per_day: float | None = Field(None, gt=0, description="Spend cap per UTC day.")


class BudgetSpec(Caps):
    """What a pipeline may spend (`core.budget`): its caps for every lane together, and
    each lane's own within them (`live`, `replay`: a backfill apart from real-time
    traffic). At a cap a lane stops taking work until the next window; nothing is
    dead-lettered."""

    live: Caps | None = None
    replay: Caps | None = None

    def describe(self) -> str:
        """The caps in a line: `$50/day, replay $2/hour` (or `none`)."""
        parts = [
            f"{scope}${usd:g}/{window}"
            for scope, caps in (("", self), ("live ", self.live), ("replay ", self.replay))
            if caps is not None
            for window, usd in (("hour", caps.usd_per_hour), ("day", caps.usd_per_day))
            if usd is not None
        ]
        return ", ".join(parts) or "none"


class ReviewSpec(BaseModel):
    """Results a person should look at: they also go to the review topic, with reasons."""

    model_config = WRITTEN

    confidence_below: float | None = Field(None, ge=0, le=1)
    confidence_field: str = "confidence"
    rules: dict[str, str] = Field(
        default_factory=dict,
        description="name -> Jinja expression over `input` and `output`; true flags it.",
    )


PiiKind = Literal["email", "cn_id", "bank_card", "phone"]


class PreprocessSpec(BaseModel):
    """Cleaning and PII redaction of every string slot before rendering (all on by default)."""

    model_config = WRITTEN

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
    model_config = WRITTEN

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
    budget: BudgetSpec | None = None
    sink: SinkSpec | None = Field(
        None,
        description="Its answers written again to a topic of the user's, in the shape and "
        "under the key they want (streams.pipelines.sinks); none: the results topic only.",
    )
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
    def _avro_enriched_has_a_schema(self) -> PipelineSpec:
        sink = self.sink
        if sink is None or sink.format != "avro" or sink.shape != "enriched":
            return self
        if self.source is None or self.source.format != "registry":
            raise ValueError("sink: an enriched Avro record is the source record with the "
                             "answer added, its schema the source's: the source must be read "
                             "with `format: registry`")  # fmt: skip
        if len(self.source.topics) != 1:
            raise ValueError("sink: an enriched Avro record takes its source topic's schema: "
                             "one source topic")  # fmt: skip
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
