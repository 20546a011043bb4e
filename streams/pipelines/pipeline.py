"""A named pipeline: its versions, output schema and validator, source mapping, review
rules, stages, and the A/B split."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema
import jsonschema_rs
import orjson
from jinja2 import TemplateError, Undefined

from streams.errors import ConfigError, InvalidInput
from streams.pipelines.defaults import has_defaults
from streams.pipelines.jinja import ENV
from streams.pipelines.render import (
    PipelineVersion,
)
from streams.pipelines.sources import SourceMapper
from streams.pipelines.specs import (
    PipelineSpec,
    SessionSpec,
    StageSpec,
)
from streams.preprocess import Redactor


def _fetch_nothing(uri: str) -> Any:
    raise ValueError(f"{uri} is not in the schema, and schemas are never fetched")


def offline_validator(schema: dict[str, Any]) -> Any:
    """The Rust validator of an output schema whose every `$ref` resolves within it.
    ValueError otherwise: the Rust validator would fetch a schema named by URL at each
    start (and the Python one, which writes the error messages, would not)."""
    try:
        return jsonschema_rs.validator_for(schema, retriever=_fetch_nothing)
    except ValueError as exc:  # jsonschema_rs.ValidationError: a ref, a pattern
        first = str(exc).splitlines()[0] if str(exc) else repr(exc)
        raise ValueError(f"{first} (every $ref must point within the schema: put what it "
                         "names under $defs)") from None  # fmt: skip


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
        self.is_valid = offline_validator(output_schema).is_valid
        # Optional fields with a `default` are filled in every output (defaults shown).
        self.fills_defaults = has_defaults(output_schema)
        self.versions = {v: PipelineVersion(self, v, s) for v, s in spec.versions.items()}
        self.source = (
            SourceMapper(spec.name, spec.source, spec.sink, self.session)
            if spec.source is not None
            else None
        )
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
    def stage_digests(self) -> list[str]:
        """Its later stages' definitions, in order (`Stage.digest`)."""
        return [stage.digest for stage in self.stages]

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
    """A resolved stage: its pipeline, and its expressions compiled. `digest`: what its
    answers are made of (`stage_digest`)."""

    name: str
    pipeline: Pipeline
    version: str | None
    when: Callable[..., Any] | None
    inputs: dict[str, Callable[..., Any]]
    digest: str

    def applies(self, context: dict[str, Any]) -> bool:
        return self.when is None or bool(self.when(**context))

    def build_input(self, context: dict[str, Any]) -> dict[str, Any]:
        built = {}
        for slot, expression in self.inputs.items():
            value = expression(**context)
            built[slot] = None if isinstance(value, Undefined) else value
        return built


def resolve_stages(pipeline: Pipeline, pipelines: dict[str, Pipeline]) -> None:
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
        stages.append(Stage(spec.name, target, spec.version, when, inputs,
                            stage_digest(spec, target)))  # fmt: skip
    pipeline.stages = stages
    for version in pipeline.versions.values():  # a digest read before now knew no stages
        version.__dict__.pop("digest", None)


def stage_digest(spec: StageSpec, target: Pipeline) -> str:
    """What a stage's answers are made of, hashed: its condition and input, and the
    definitions of the versions of its pipeline a task may get (the one it names; else
    those of that pipeline's traffic split, with the weights, or its default)."""
    if spec.version is not None:
        versions, split = [spec.version], None
    elif target.spec.traffic:
        split = {name: w for name, w in target.spec.traffic.items() if w > 0}
        versions = sorted(split)
    else:
        versions, split = [target.spec.default_version], None
    made_of = {
        "stage": spec.model_dump(mode="json", exclude_defaults=True),
        "split": split,
        "versions": {name: target.versions[name].digest for name in versions},
    }
    return hashlib.blake2b(orjson.dumps(made_of, option=orjson.OPT_SORT_KEYS),
                           digest_size=8).hexdigest()  # fmt: skip
