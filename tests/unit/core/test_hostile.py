"""Outcomes always fit their topics, and a bug is an internal error, not a provider fault."""

from __future__ import annotations

import asyncio
import base64
from dataclasses import replace
from pathlib import Path

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streams.contract.records import BOM, Source, ValueLimits
from streams.core.processor import Outcome
from streams.core.spend import Prices
from streams.errors import REDRIVABLE, Category
from streams.llm.client import parse_completion
from tests.conftest import MakeProcessor
from tests.fakes import FakeLLM, answer

ROOT = Path(__file__).resolve().parents[3]
SRC = Source(topic="t", partition=0, offset=7)
GOOD = {"sentiment": "positive", "confidence": 0.9, "topics": ["quality"], "issues": [],
        "summary": "good", "language": "en"}  # fmt: skip


def task(text: str) -> bytes:
    return orjson.dumps({"task_id": "t1", "pipeline": "comment-analysis", "input": {"text": text}})


async def test_a_result_over_what_the_results_topic_takes_is_a_dead_letter(
    make_processor: MakeProcessor,
) -> None:
    llm = FakeLLM(lambda _r: answer(GOOD, prompt_tokens=100, completion_tokens=20))
    out = await make_processor(
        llm, limits=ValueLimits(result=300, dead_letter=100_000), prices=Prices(1.0, 2.0)
    ).process(task("Great phone."), b"t1", SRC)
    assert out.kind == "dead_letter" and out.category == "output_too_large"
    letter = orjson.loads(out.value)
    assert letter["error"]["code"] == "result_too_large" and not letter["error"]["retryable"]
    assert "300 bytes" in letter["error"]["message"]
    # The call was made and paid for: the dead letter says so.
    assert out.attempts == 1 and out.prompt_tokens == 100 and out.cost_usd > 0
    assert Category.OUTPUT_TOO_LARGE not in REDRIVABLE  # the same answer would come back


async def test_an_oversized_input_is_dead_lettered_with_a_head_that_fits(
    make_processor: MakeProcessor,
) -> None:
    raw = task("x" * 3_000_000)
    out = make_processor(
        FakeLLM(), limits=ValueLimits(dead_letter=50_000), max_task_bytes=65_536
    ).intake.prepare(raw, b"t1", SRC)
    assert isinstance(out, Outcome) and out.category == "invalid_input"
    letter = orjson.loads(out.value)
    assert len(out.value) <= 50_000 and letter["error"]["code"] == "too_large"
    assert letter["payload"]["truncated"] and letter["payload"]["size"] == len(raw)
    assert letter["task_id"] == "t1"


async def test_a_bug_in_the_worker_is_an_internal_error_never_retried(
    monkeypatch: pytest.MonkeyPatch, make_processor: MakeProcessor
) -> None:
    llm = FakeLLM(lambda _r: answer(GOOD))
    processor = make_processor(llm)

    def broken(*_args: object, **_kwargs: object) -> object:
        raise KeyError("a bug")

    monkeypatch.setattr("streams.core.calls.parse_output", broken)
    out = await processor.process(task("Great phone."), b"t1", SRC)
    letter = orjson.loads(out.value)
    assert out.category == "internal_error" == letter["error"]["category"]
    assert letter["error"]["retryable"] is False and len(llm.requests) == 1
    assert Category.INTERNAL_ERROR not in REDRIVABLE


async def test_a_task_nested_too_deep_to_write_back_is_its_dead_letter_not_a_crash(
    make_processor: MakeProcessor,
) -> None:
    """1.8 KB of JSON nested 300 deep: orjson reads it, and writes neither its keys nor a
    dead letter holding it. It used to raise out of the processor (the lane's crash, and
    the same record again after the restart)."""
    inner = b'{"x": ' * 300 + b"1" + b"}" * 300
    raw = b'{"task_id": "t1", "pipeline": "comment-analysis", "input": {"text": ' + inner + b"}}"
    llm = FakeLLM(lambda _r: answer(GOOD))
    out = await make_processor(llm).process(raw, b"t1", SRC)
    assert out.kind == "dead_letter" and out.category == "invalid_input"
    letter = orjson.loads(out.value)
    assert letter["error"]["code"] == "too_deep" and letter["task_id"] == "t1"
    assert base64.b64decode(letter["payload"]["raw_base64"]) == raw  # the bytes, kept
    assert llm.requests == []


async def test_an_answer_nested_too_deep_to_write_back_is_invalid_output(
    make_processor: MakeProcessor,
) -> None:
    """A model's answer nested 300 deep would pass a schema that leaves a field open, and
    its result could not be written: it is an invalid answer (repaired, then dead-lettered
    as `invalid_output`), not a bug of the worker."""
    deep = orjson.dumps(GOOD)[:-1] + b', "notes": ' + b"[" * 300 + b"]" * 300 + b"}"
    llm = FakeLLM(lambda _r: answer(deep.decode()))
    out = await make_processor(llm).process(task("Great phone."), b"t1", SRC)
    assert out.kind == "dead_letter" and out.category == "invalid_output"
    assert orjson.loads(out.value)["error"]["code"] == "too_deep"
    assert len(llm.requests) == 2  # the answer, and its repair


_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
                     st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))  # fmt: skip
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)  # fmt: skip
_GOOD = orjson.dumps(GOOD).decode()
_COUNT = st.integers(-5, 10**6) | st.floats(-1, 1e6) | st.text(max_size=4) | _JSON
_PARTS = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "thinking"]),
                                         "text": st.just(_GOOD) | _JSON}) | _JSON, max_size=3)  # fmt: skip
_MESSAGE = st.fixed_dictionaries({}, optional={
    "content": st.just(_GOOD) | st.text(max_size=20) | _PARTS | _JSON,
    "tool_calls": st.lists(st.fixed_dictionaries({"function": st.fixed_dictionaries(
        {}, optional={"arguments": st.just(_GOOD) | _JSON})})) | _JSON})  # fmt: skip
_BODY = st.fixed_dictionaries(
    {"choices": st.lists(st.fixed_dictionaries({}, optional={
        "message": _MESSAGE | _JSON,
        "finish_reason": st.sampled_from(["stop", "length", "tool_calls"]) | _JSON}),
        min_size=1, max_size=2) | _JSON},
    optional={"usage": st.fixed_dictionaries({}, optional={
        "prompt_tokens": _COUNT, "completion_tokens": _COUNT,
        "prompt_tokens_details": st.fixed_dictionaries({"cached_tokens": _COUNT}) | _JSON,
    }) | _JSON, "model": _JSON, "timings": _JSON, "service_tier": _JSON},
)  # fmt: skip


@settings(max_examples=300, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
@given(body=_BODY)
def test_whatever_a_server_answers_the_task_ends_as_a_result_or_a_dead_letter_saying_why(
    make_processor: MakeProcessor, body: dict[str, object]
) -> None:
    """Bodies as servers other than OpenAI might send them, garbled anywhere: the task is
    answered, or dead-lettered as the server's fault or the answer's — never a bug of the
    worker's (before: content in parts or a negative token count was `internal_error`,
    and the answer, paid for, was dropped)."""
    raw = orjson.dumps(body)
    llm = FakeLLM(lambda _r: parse_completion(raw, "m"))
    out = asyncio.run(make_processor(llm).process(task("Great phone."), b"t1", SRC))
    assert out.kind == "result" or out.category in ("upstream_error", "invalid_output"), (
        body, out.value
    )  # fmt: skip


@pytest.mark.parametrize("finish", ["error", "abort", "ABORT"])
async def test_an_answer_the_endpoint_ended_with_an_error_is_asked_again_and_paid_for(
    make_processor: MakeProcessor, finish: str
) -> None:
    """OpenRouter ends an answer whose model failed mid-way with `finish_reason: "error"`,
    vLLM and SGLang one their engine aborted (a pause, shutdown, scale-down) with "abort",
    each with HTTP 200 and what it had written. That partial text was parsed as the answer:
    a repair asked of the model about text it never finished. It is the endpoint's failure
    now, asked again, and its tokens counted in the task's spend all the same."""
    answers = iter([replace(answer('{"sentiment": "pos'), finish_reason=finish), answer(GOOD)])
    llm = FakeLLM(lambda _r: next(answers))
    out = await make_processor(llm, prices=Prices(1.0, 2.0)).process(task("Great."), b"t1", SRC)
    assert out.kind == "result" and out.attempts == 2 and len(llm.requests) == 2
    assert out.prompt_tokens == 20  # both calls' tokens: the failed one was paid too
    assert orjson.loads(out.value)["rejected_answers"] == 0  # not the model's invalid answer


async def test_a_record_after_a_utf8_byte_order_mark_is_read_as_its_json(
    make_processor: MakeProcessor,
) -> None:
    """Windows tools write one before a file's text, and a file produced line by line
    carries it into its first record: it was `not_json` (orjson refuses it; Jackson and
    Python's json read past it, as RFC 8259 allows)."""
    processor = make_processor(FakeLLM(lambda _r: answer(GOOD)))
    raw = BOM + task("Great phone.")
    assert processor.intake.route_of(raw) == ("t1", "t1")  # routed as it is decoded
    out = await processor.process(raw, b"t1", SRC)
    assert out.kind == "result" and orjson.loads(out.value)["task_id"] == "t1"
    # Bad input after one is still bad input, kept as JSON where it is JSON.
    letter = orjson.loads((await processor.process(BOM + b'{"task_id": "t2"}', b"t2", SRC)).value)
    assert letter["task_id"] == "t2" and letter["payload"] == {"task_id": "t2"}


@pytest.mark.parametrize("number", [b"18446744073709551616", b"-9223372036854775809",
                                    b"123456789012345678901234567890", b"1" * 300])  # fmt: skip
async def test_an_integer_beyond_64_bits_is_a_dead_letter_keeping_the_record_exactly(
    make_processor: MakeProcessor, number: bytes
) -> None:
    """orjson reads such an integer as a double: an order id of 20+ digits changed its
    value in the prompt, the result key and an enriched sink record, and two ids could
    read as one. It is refused, saying so, and the dead letter keeps the record's bytes."""
    llm = FakeLLM(lambda _r: answer(GOOD))
    processor = make_processor(llm)
    raw = (b'{"task_id": "t1", "pipeline": "comment-analysis", "input": {"text": "Great.", '
           b'"order_id": ' + number + b"}}")  # fmt: skip
    out = await processor.process(raw, b"t1", SRC)
    assert out.kind == "dead_letter" and out.category == "invalid_input" and llm.requests == []
    letter = orjson.loads(out.value)
    assert "beyond 64 bits" in letter["error"]["message"] and letter["task_id"] == "t1"
    assert base64.b64decode(letter["payload"]["raw_base64"]) == raw
    # At the edges of what orjson holds, and in a string, the record is answered.
    for fits in (b"18446744073709551615", b"-9223372036854775808", b'"' + number + b'"'):
        ok = await processor.process(raw.replace(number, fits), b"t1", SRC)
        assert ok.kind == "result", ok.value
