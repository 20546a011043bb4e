"""Outcomes always fit their topics, and a bug is an internal error, not a provider fault."""

from __future__ import annotations

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
