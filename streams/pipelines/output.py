"""Output contract: parse the model's answer, validate it, check quoted evidence."""

from __future__ import annotations

import re
from typing import Any

import orjson

from streams.errors import InvalidOutput
from streams.llm.client import LLMResponse
from streams.pipelines.defaults import fill_defaults
from streams.pipelines.registry import Pipeline

_SPACE = re.compile(r"\s+")


def _squash(text: str) -> str:
    return _SPACE.sub(" ", text).strip()


def _values_at(data: Any, path: list[str]) -> list[Any]:
    if not path:
        return [data]
    head, rest = path[0], path[1:]
    many = head.endswith("[]")
    name = head[:-2] if many else head
    if not isinstance(data, dict) or name not in data:
        return []
    value = data[name]
    if many:
        if not isinstance(value, list):
            return []
        return [v for item in value for v in _values_at(item, rest)]
    return _values_at(value, rest)


def parse_output(
    response: LLMResponse, pipeline: Pipeline, variables: dict[str, Any]
) -> dict[str, Any]:
    """The validated output object, or InvalidOutput saying what is wrong with it."""
    if response.finish_reason == "length":
        raise InvalidOutput("answer was cut at max_tokens (finish_reason=length)", code="truncated")
    try:
        data = orjson.loads(response.content)
    except orjson.JSONDecodeError as exc:
        raise InvalidOutput(f"answer is not JSON: {exc}", code="not_json") from exc
    return check_output(data, pipeline, variables)


def check_output(data: Any, pipeline: Pipeline, variables: dict[str, Any]) -> dict[str, Any]:
    """A decoded answer checked against the output contract (schema, quoted evidence),
    optional fields filled with their defaults; or InvalidOutput saying what is wrong."""
    if not isinstance(data, dict):
        raise InvalidOutput(
            f"answer is JSON {type(data).__name__}, not an object", code="not_object"
        )
    errors = (
        []
        if pipeline.is_valid(data)
        else sorted(pipeline.validator.iter_errors(data), key=lambda e: list(e.absolute_path))
    )
    if errors:
        detail = "; ".join(
            f"{'/'.join(str(p) for p in e.absolute_path) or '(root)'}: {e.message}"
            for e in errors[:5]
        )
        raise InvalidOutput(f"answer breaks the output schema: {detail}", code="schema")
    source_slot = pipeline.spec.quote_source
    if source_slot and pipeline.spec.quote_fields:
        source = _squash(str(variables.get(source_slot) or ""))
        for field in pipeline.spec.quote_fields:
            for quote in _values_at(data, field.split(".")):
                if isinstance(quote, str) and _squash(quote) not in source:
                    raise InvalidOutput(
                        f"{field} {quote[:80]!r} is not a quote of input.{source_slot}",
                        code="evidence_not_quoted",
                    )
    if pipeline.fills_defaults:
        fill_defaults(data, pipeline.output_schema, pipeline.output_schema)  # in place
    return data
