"""Outcomes always fit their topics, and a bug is an internal error, not a provider fault."""

from __future__ import annotations

import base64
from pathlib import Path

import orjson
import pytest

from streams.contract.records import Source, ValueLimits
from streams.core.processor import Outcome
from streams.core.spend import Prices
from streams.errors import REDRIVABLE, Category
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
