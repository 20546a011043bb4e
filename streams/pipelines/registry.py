"""Load `pipelines/*.yaml` into checked pipelines (`PipelineRegistry`); a pipeline's parts
live in `specs` (what a file says), `structured` (structured-output modes), `render`
(a prompt version) and `pipeline` (a pipeline, its stages and its split)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import yaml
from pydantic import ValidationError

from streams.contract.mistakes import mistakes_of
from streams.errors import ConfigError, InvalidInput
from streams.pipelines.pipeline import (
    Pipeline,
    offline_validator,
    resolve_stages,
)
from streams.pipelines.render import PipelineVersion
from streams.pipelines.sinks import SinkSpec
from streams.pipelines.sources import SourceMapper
from streams.pipelines.specs import (
    PipelineSpec,
)


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
            resolve_stages(pipeline, pipelines)
        return cls(pipelines)

    def sources(self) -> dict[str, list[SourceMapper]]:
        """Source topic -> the mappings of the pipelines that read it."""
        found: dict[str, list[SourceMapper]] = {}
        for pipeline in self.pipelines.values():
            if pipeline.source is not None:
                for topic in pipeline.source.spec.topics:
                    found.setdefault(topic, []).append(pipeline.source)
        return found

    def sinks(self) -> dict[str, list[str]]:
        """Sink topic (and pipelines' dead-letter copies) -> the pipelines writing it."""
        found: dict[str, list[str]] = {}
        for name, pipeline in self.pipelines.items():
            sink = pipeline.spec.sink
            if sink is not None:
                for topic in filter(None, (sink.topic, sink.dead_letters)):
                    found.setdefault(topic, []).append(name)
        return found

    def sink_of(self, pipeline: str) -> SinkSpec | None:
        """A pipeline's sink (None: it has none, or there is no such pipeline)."""
        found = self.pipelines.get(pipeline)
        return found.spec.sink if found is not None else None

    def models_used(self, default: str) -> dict[str, list[PipelineVersion]]:
        """Each model the pipelines' versions ask for (`default`: the model of those naming
        none), with the versions asking for it, by pipeline and version name."""
        found: dict[str, list[PipelineVersion]] = {}
        for _, pipeline in sorted(self.pipelines.items()):
            for _, version in sorted(pipeline.versions.items()):
                found.setdefault(version.spec.model or default, []).append(version)
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


def _read_spec(path: Path) -> PipelineSpec:
    try:
        return PipelineSpec.model_validate(yaml.safe_load(path.read_text(encoding="utf-8")))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not YAML: {' '.join(str(exc).split())}") from exc
    except ValidationError as exc:
        mistakes = mistakes_of(exc, PipelineSpec)
        if len(mistakes) == 1:
            raise ConfigError(f"{path}: {mistakes[0]}") from exc
        listed = "".join(f"\n  {m}" for m in mistakes)
        raise ConfigError(f"{path}: {len(mistakes)} mistakes:{listed}") from exc


def _load_one(path: Path, schemas_dir: Path) -> Pipeline:
    spec = _read_spec(path)
    schema_path = schemas_dir / spec.output_schema
    try:
        schema = json.loads(schema_path.read_text(encoding="utf-8"))
        jsonschema.Draft202012Validator.check_schema(schema)
        offline_validator(schema)
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
