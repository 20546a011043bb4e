from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from streams.errors import InvalidOutput
from streams.llm.client import LLMResponse
from streams.pipelines.output import parse_output
from streams.pipelines.pipeline import Pipeline
from streams.pipelines.registry import PipelineRegistry
from streams.pipelines.specs import PipelineSpec

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
        # Mistral: the model's window was full; a gateway passing on Anthropic's words.
        (orjson.dumps(GOOD)[:40].decode(), "model_length", "truncated"),
        (orjson.dumps(GOOD)[:40].decode(), "max_tokens", "truncated"),
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


def _pipeline_with(schema: dict[str, object]) -> Pipeline:
    spec = PipelineSpec(
        name="p", default_version="v1", output_schema="s.json",
        versions={"v1": {"system": "s", "template": "{{ text }}",
                         "slots": {"text": {"type": "string"}}, "response_format": "json_object"}},
    )  # fmt: skip
    return Pipeline(spec, schema)


SCHEMA_WITH_DEFAULTS = {
    "type": "object",
    "required": ["label"],
    "properties": {
        "label": {"type": "string"},
        "confidence": {"type": "number", "default": 0.5},
        "tags": {"type": "array", "items": {"type": "string"}, "default": []},
        "issues": {"type": "array", "items": {"$ref": "#/$defs/issue"}},
        "meta": {"type": "object", "properties": {"lang": {"type": "string", "default": "und"}}},
    },
    "$defs": {
        "issue": {
            "type": "object",
            "required": ["what"],
            "properties": {"what": {"type": "string"}, "severity": {"default": "low"}},
        }
    },
}


def test_defaults_of_optional_fields_are_filled_and_present_values_kept() -> None:
    pipeline = _pipeline_with(SCHEMA_WITH_DEFAULTS)
    assert pipeline.fills_defaults
    answer = {"label": "x", "tags": ["kept"], "issues": [{"what": "a"}, {"what": "b",
              "severity": "high"}], "meta": {}}  # fmt: skip
    out = parse_output(_resp(orjson.dumps(answer).decode()), pipeline, {})
    assert out == {
        "label": "x", "confidence": 0.5, "tags": ["kept"],
        "issues": [{"what": "a", "severity": "low"}, {"what": "b", "severity": "high"}],
        "meta": {"lang": "und"},
    }  # fmt: skip
    # Each output gets its own copy of a default, never a shared object.
    one = parse_output(_resp('{"label": "y"}'), pipeline, {})
    two = parse_output(_resp('{"label": "z"}'), pipeline, {})
    one["tags"].append("changed")
    assert two["tags"] == [] and "meta" not in two


def test_a_schema_without_defaults_leaves_outputs_as_answered(pipeline: Pipeline) -> None:
    assert not pipeline.fills_defaults
    out = parse_output(_resp(orjson.dumps(GOOD).decode()), pipeline, {"text": "arrived late"})
    assert out == GOOD


def _with_evidence(evidence: str) -> str:
    return orjson.dumps({**GOOD, "issues": [{"category": "delivery", "evidence": evidence}]}
                        ).decode()  # fmt: skip


@pytest.mark.parametrize(
    ("text", "evidence"),
    [
        # capitals differ (3 of 16 true quotes were refused by a real model's run)
        ("the blender itself works great, but it arrived late.", "The blender itself works great"),
        # a full-width comma in the comment, an ASCII one in the quote
        ("物流很快，东西不错。", "物流很快,东西不错"),
        ("ＡＢＣ　full-width letters and spaces", "abc full-width letters"),
    ],
)
def test_quotes_are_checked_as_people_quote(pipeline: Pipeline, text: str, evidence: str) -> None:
    out = parse_output(_resp(_with_evidence(evidence)), pipeline, {"text": text})
    assert out["issues"][0]["evidence"] == evidence


@pytest.mark.parametrize("evidence", ["the blender works well", "it never arrived"])
def test_a_paraphrase_or_an_invented_quote_is_still_refused(
    pipeline: Pipeline, evidence: str
) -> None:
    with pytest.raises(InvalidOutput) as info:
        parse_output(_resp(_with_evidence(evidence)), pipeline,
                     {"text": "The blender itself works great, but it arrived late."})  # fmt: skip
    assert info.value.code == "evidence_not_quoted"


def test_a_quote_of_the_comment_as_it_came_passes_though_cleaning_changed_it(
    pipeline: Pipeline,
) -> None:
    """The prompt had the cleaned text (markup stripped, say); the model quoted the comment
    as the task gave it."""
    cleaned = {"text": "Great kettle. Lid broke."}
    original = {"text": "Great <b>kettle</b>. Lid broke."}
    out = parse_output(_resp(_with_evidence("Great <b>kettle</b>")), pipeline, cleaned, original)
    assert out["issues"][0]["evidence"] == "Great <b>kettle</b>"


def test_an_answer_in_a_code_fence_is_read_as_the_json_inside(pipeline: Pipeline) -> None:
    fenced = "```json\n" + orjson.dumps(GOOD).decode() + "\n```"
    assert parse_output(_resp(fenced), pipeline, {"text": "It arrived late. Bad."}) == GOOD
    with pytest.raises(InvalidOutput) as info:
        parse_output(_resp("```json\n{oops\n```"), pipeline, {"text": "x"})
    assert info.value.code == "not_json"


def test_an_answer_with_an_integer_beyond_64_bits_is_invalid_not_changed() -> None:
    """An answer whose integer orjson would read as a double (an order id of 20 digits)
    is invalid output — asked again — instead of a result carrying another number; the
    same digits in a string, the edges that fit, and the same in a fenced answer are
    read as they are."""
    pipeline = _pipeline_with({"type": "object", "required": ["order"],
                               "properties": {"order": {}}})  # fmt: skip
    for big in ("18446744073709551616", "-9223372036854775809", "123456789012345678901234"):
        for content in (f'{{"order": {big}}}', f'```json\n{{"order": {big}}}\n```'):
            with pytest.raises(InvalidOutput) as info:
                parse_output(_resp(content), pipeline, {"text": "x"})
            assert info.value.code == "not_json" and "beyond 64 bits" in info.value.message
    for fits in (18446744073709551615, -9223372036854775808, "18446744073709551616"):
        content = orjson.dumps({"order": fits}).decode()
        assert parse_output(_resp(content), pipeline, {"text": "x"}) == {"order": fits}
        assert parse_output(_resp(f"```json\n{content}\n```"), pipeline, {"text": "x"}) == {
            "order": fits
        }
