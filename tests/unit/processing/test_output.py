from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from streams.errors import InvalidOutput
from streams.llm.client import LLMResponse
from streams.processing.output import parse_output
from streams.prompts.registry import Pipeline, PipelineRegistry

ROOT = Path(__file__).resolve().parents[3]
GOOD = {
    "sentiment": "negative", "confidence": 0.9, "topics": ["delivery"],
    "issues": [{"category": "delivery", "evidence": "arrived   late"}],
    "summary": "late", "language": "en",
}  # fmt: skip


@pytest.fixture
def pipeline() -> Pipeline:
    return PipelineRegistry.load(ROOT / "pipelines", ROOT / "schemas").get("comment-analysis")


def _resp(content: str, finish: str = "stop") -> LLMResponse:
    return LLMResponse(
        content=content, model="m", prompt_tokens=1, completion_tokens=1, finish_reason=finish
    )


def test_valid_output_passes(pipeline: Pipeline) -> None:
    out = parse_output(
        _resp(orjson.dumps(GOOD).decode()), pipeline, {"text": "It arrived late. Bad."}
    )
    assert out == GOOD


@pytest.mark.parametrize(
    ("content", "finish", "code"),
    [
        ('{"sentiment": "neg', "stop", "not_json"),
        ("[1, 2]", "stop", "not_object"),
        (orjson.dumps({**GOOD, "sentiment": "angry"}).decode(), "stop", "schema"),
        (orjson.dumps({**GOOD, "confidence": 2}).decode(), "stop", "schema"),
        (
            orjson.dumps({k: v for k, v in GOOD.items() if k != "summary"}).decode(),
            "stop",
            "schema",
        ),
        (orjson.dumps({**GOOD, "extra": 1}).decode(), "stop", "schema"),
        (orjson.dumps(GOOD).decode(), "length", "truncated"),
        (
            orjson.dumps(
                {**GOOD, "issues": [{"category": "price", "evidence": "too pricey"}]}
            ).decode(),
            "stop",
            "evidence_not_quoted",
        ),
    ],
)
def test_invalid_outputs_say_why(pipeline: Pipeline, content: str, finish: str, code: str) -> None:
    with pytest.raises(InvalidOutput) as info:
        parse_output(_resp(content, finish), pipeline, {"text": "It arrived late. Bad."})
    assert info.value.code == code
    assert info.value.retryable
