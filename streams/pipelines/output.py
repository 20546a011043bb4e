"""Output contract: parse the model's answer, validate it, check quoted evidence.

An answer in a Markdown code fence (```json ... ```, as small models and endpoints that
ignore `response_format` write it) is read as the JSON inside. Evidence is checked as
people quote: against the text the model saw (cleaned) and the text as it came, both
sides NFKC-normalised (full-width punctuation and letters as their plain forms) and
case-folded, whitespace squashed — a quote that differs only in capitals or in a
full-width comma passes; one that paraphrases or invents does not.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping
from typing import Any

import orjson

from streams.contract.records import MAX_DEPTH, too_deep
from streams.errors import InvalidOutput, OutputRejected, UpstreamError
from streams.llm.client import LLMResponse, finish_fault, json_answer
from streams.pipelines.defaults import fill_defaults
from streams.pipelines.pipeline import Pipeline

_SPACE = re.compile(r"\s+")


def _squash(text: str) -> str:
    return _SPACE.sub(" ", text).strip()


def _as_quoted(text: str) -> str:
    """Text as quotes are compared: NFKC, case-folded, whitespace squashed."""
    return _squash(unicodedata.normalize("NFKC", text).casefold())


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
    response: LLMResponse,
    pipeline: Pipeline,
    variables: dict[str, Any],
    originals: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The validated output object, or InvalidOutput saying what is wrong with it.
    `variables`: the slots as the prompt had them; `originals`: as the task gave them."""
    fault, said = finish_fault(response.finish_reason), response.finish_reason[:100]
    if fault == "truncated":
        raise InvalidOutput(f"answer was cut at max_tokens (finish_reason={said})",
                            code="truncated")  # fmt: skip
    if fault == "failed":  # the server gave up mid-answer: its text is partial
        raise UpstreamError(f"the endpoint ended the answer with an error (finish_reason={said})",
                            code="finish_error")  # fmt: skip
    # Asked again, the same input meets the same filter or refusal: paid for, not repaired.
    if fault == "filtered":
        raise OutputRejected("the provider's content filter withheld the answer "
                             f"(finish_reason={said})", code="content_filter")  # fmt: skip
    if response.refusal is not None and not response.content.strip():
        raise OutputRejected(f"the model refused to answer: {response.refusal[:500]}",
                             code="refusal")  # fmt: skip
    try:
        data = json_answer(response.content)
    except orjson.JSONDecodeError as exc:
        raise InvalidOutput(f"answer is not JSON: {exc}", code="not_json") from exc
    if too_deep(data, response.content):
        raise InvalidOutput(f"answer nests objects and arrays over {MAX_DEPTH} levels deep",
                            code="too_deep")  # fmt: skip
    return check_output(data, pipeline, variables, originals)


def check_output(
    data: Any,
    pipeline: Pipeline,
    variables: dict[str, Any],
    originals: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
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
        sources = [_as_quoted(str(variables.get(source_slot) or ""))]
        if originals is not None and originals.get(source_slot) is not None:
            sources.append(_as_quoted(str(originals[source_slot])))
        for field in pipeline.spec.quote_fields:
            for quote in _values_at(data, field.split(".")):
                if isinstance(quote, str) and not any(_as_quoted(quote) in s for s in sources):
                    raise InvalidOutput(
                        f"{field} {quote[:80]!r} is not a quote of input.{source_slot}",
                        code="evidence_not_quoted",
                    )
    if pipeline.fills_defaults:
        fill_defaults(data, pipeline.output_schema, pipeline.output_schema)  # in place
    return data
