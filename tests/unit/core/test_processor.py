"""The processor against the simulator through the real OpenAI SDK: every fault ends right."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from streams.contract.records import Source, result_key
from streams.core.processor import TaskProcessor
from streams.core.spend import Prices
from streams.core.window import WINDOW_SHARE
from streams.dev.simulator import SimulatorServer
from streams.llm.openai_client import OpenAIClient
from streams.llm.tokens import count_messages
from streams.observability.metrics import Metrics
from streams.pipelines.registry import PipelineRegistry
from streams.resilience.breaker import CircuitBreaker, State
from streams.resilience.guarded import GuardedClient
from streams.resilience.limiter import RateLimiter
from streams.resilience.retry import RetryPolicy
from tests.conftest import MakeProcessor

ROOT = Path(__file__).resolve().parents[3]
SRC = Source(topic="t", partition=0, offset=7)


@pytest.fixture
async def processor(
    simulator: SimulatorServer, make_processor: MakeProcessor
) -> AsyncIterator[TaskProcessor]:
    client = OpenAIClient(
        base_url=simulator.base_url, api_key="k", connect_timeout_s=1, read_timeout_s=0.5
    )
    guarded = GuardedClient(
        client, limiter=RateLimiter(rpm=1_000_000), breaker=CircuitBreaker("sim", min_calls=1000)
    )
    yield make_processor(guarded=guarded, prices=Prices(prompt_per_1k=1.0, completion_per_1k=2.0))
    await client.close()


def _task(text: str = "Arrived late, box crushed. Works great though.") -> bytes:
    return orjson.dumps({"task_id": "t1", "pipeline": "comment-analysis", "input": {"text": text}})


async def test_success_yields_a_contract_result(
    processor: TaskProcessor, simulator: SimulatorServer
) -> None:
    out = await processor.process(_task(), b"t1", SRC)
    assert out.kind == "result"
    r = orjson.loads(out.value)
    assert (
        out.key
        == r["result_key"]
        == result_key(
            "comment-analysis",
            "v1",
            "t1",
            {"text": "Arrived late, box crushed. Works great though."},
        )
    )
    assert r["output"]["sentiment"] == "mixed" and r["attempts"] == 1 and r["model"] == "sim-1"
    assert r["source"] == {"topic": "t", "partition": 0, "offset": 7}
    usage = r["usage"]
    assert r["cost_usd"] == pytest.approx(
        usage["prompt_tokens"] / 1000 + usage["completion_tokens"] * 2 / 1000
    )


@pytest.mark.parametrize("usage", ["none", "zeros"])
async def test_an_answer_without_token_usage_is_counted_here_and_priced(
    processor: TaskProcessor, simulator: SimulatorServer, usage: str
) -> None:
    """A gateway or an older local server that says no usage (no block, or zeros): the
    task cost $0, no cap counted it and the limiter learned no tokens. Its tokens are
    counted with the offline tokenizer instead, as what the simulator itself counted."""
    simulator.sim.config.usage = "said"
    said = orjson.loads((await processor.process(_task(), b"t1", SRC)).value)["usage"]
    simulator.sim.config.usage = usage
    out = await processor.process(_task(), b"t2", Source(topic="t", partition=0, offset=8))
    r = orjson.loads(out.value)
    assert out.kind == "result" and r["usage"]["prompt_tokens"] > 0
    assert abs(r["usage"]["prompt_tokens"] - said["prompt_tokens"]) <= 0.1 * said["prompt_tokens"]
    assert r["usage"]["completion_tokens"] > 0
    assert r["cost_usd"] == pytest.approx(
        r["usage"]["prompt_tokens"] / 1000 + r["usage"]["completion_tokens"] * 2 / 1000
    )
    unsaid = processor.client.metrics.registry.get_sample_value(
        "llm_streams_usage_unsaid_total", {"deployment": "default"}
    )
    assert unsaid == 1.0


@pytest.mark.parametrize(
    ("knobs", "category", "attempts", "calls"),
    [
        ({"error_500_rate": 1.0}, "upstream_error", 3, 3),
        ({"error_503_rate": 1.0}, "upstream_error", 3, 3),
        ({"malformed_rate": 1.0}, "invalid_output", 2, 2),
        ({"api_key": "other"}, "auth", 1, 1),
        ({"context_window": 20}, "context_overflow", 1, 1),
        ({"hang_rate": 1.0, "hang_s": 30}, "timeout", 3, 3),
    ],
)
async def test_faults_end_as_dead_letters_with_category_and_attempts(
    processor: TaskProcessor,
    simulator: SimulatorServer,
    knobs: dict,
    category: str,
    attempts: int,
    calls: int,
) -> None:
    simulator.sim.config.update(knobs)
    out = await processor.process(_task(), b"t1", SRC)
    assert out.kind == "dead_letter" and out.category == category
    d = orjson.loads(out.value)
    assert d["error"]["category"] == category and d["attempts"] == attempts
    assert d["payload"]["task_id"] == "t1" and d["task_id"] == "t1"
    stats = simulator.sim.snapshot()
    assert (
        stats["requests"] + stats["by_outcome"].get("hang", 0) == calls
    )  # hung calls have no status


async def test_rate_limit_is_learned_and_respected_without_429s(
    processor: TaskProcessor, simulator: SimulatorServer
) -> None:
    simulator.sim.config.rpm = 600  # 10/s, burst 10
    outs = [await processor.process(_task(f"comment {i}"), None, SRC) for i in range(12)]
    assert all(o.kind == "result" for o in outs)
    # The first answer's x-ratelimit headers taught the limiter; the burst waited instead.
    assert simulator.sim.snapshot()["by_status"] == {"200": 12}
    assert processor.client.limiter.snapshot().rpm_ceiling == 600


async def test_deadline_bounds_the_whole_task(
    processor: TaskProcessor, simulator: SimulatorServer, make_processor: MakeProcessor
) -> None:
    processor = make_processor(
        guarded=processor.client, deadline_s=0.3,
        policy=RetryPolicy(max_attempts=10, backoff_base_s=0.01, backoff_max_s=0.01),
    )  # fmt: skip
    simulator.sim.config.latency_ms = 2000
    out = await processor.process(_task(), b"t1", SRC)
    assert out.category == "deadline_exceeded"
    assert "deadline" in orjson.loads(out.value)["error"]["message"]


async def test_repair_prompt_recovers_a_malformed_answer(
    processor: TaskProcessor, simulator: SimulatorServer
) -> None:
    simulator.sim.config.malformed_rate = 1.0
    simulator.sim.config.seed = 0
    calls = 0
    original = processor.client.client.complete

    async def flaky(request):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls == 1:
            assert request.params["temperature"] == 0  # the version's own
        if calls == 2:
            simulator.sim.config.malformed_rate = 0.0
            assert "rejected" in request.messages[-1]["content"]  # the repair turn
            # sampled anew: at 0 it would say its rejected answer again
            assert request.params["temperature"] >= 0.7
        return await original(request)

    processor.client.client.complete = flaky  # type: ignore[method-assign]
    out = await processor.process(_task(), b"t1", SRC)
    assert out.kind == "result" and orjson.loads(out.value)["attempts"] == 2


async def test_bad_input_never_reaches_the_llm(
    processor: TaskProcessor, simulator: SimulatorServer
) -> None:
    out = await processor.process(b"not json", b"k1", SRC)
    assert out.kind == "dead_letter" and out.category == "invalid_input" and out.task_id == "k1"
    assert out.key == "k1"
    out = await processor.process(b"[]", None, SRC)
    assert out.key == "t/0/7" and out.task_id is None
    assert simulator.sim.snapshot()["requests"] == 0


async def test_unexpected_errors_become_dead_letters(processor: TaskProcessor) -> None:
    async def broken(request):  # type: ignore[no-untyped-def]
        raise ZeroDivisionError("bug")

    processor.client.client.complete = broken  # type: ignore[method-assign]
    out = await processor.process(_task(), b"t1", SRC)
    assert out.kind == "dead_letter"
    assert orjson.loads(out.value)["error"]["code"] == "internal_error"


async def test_rate_limits_that_outlast_the_attempts_end_as_rate_limited(
    processor: TaskProcessor,
) -> None:
    from streams.errors import RateLimited

    calls = 0

    async def always_429(request):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        raise RateLimited("HTTP 429", retry_after=0.01, code="rate_limit_exceeded")

    processor.client.client.complete = always_429  # type: ignore[method-assign]
    out = await processor.process(_task(), b"t1", SRC)
    d = orjson.loads(out.value)
    assert d["error"]["category"] == "rate_limited" and d["error"]["retryable"] is True
    assert d["attempts"] == 3 == calls
    assert processor.client.limiter.snapshot().rpm < 1_000_000  # each 429 cut the rate


async def test_an_open_circuit_past_the_deadline_is_circuit_open(processor: TaskProcessor) -> None:
    breaker = processor.client.breaker
    breaker.open_s = 3600
    for _ in range(breaker.min_calls):  # the endpoint failed every call of the window
        admission = breaker.admit()
        assert admission is not None
        breaker.settle(admission, ok=False)
    assert breaker.state is State.OPEN
    out = await processor.process(_task(), b"t1", SRC)
    d = orjson.loads(out.value)
    assert d["error"]["category"] == "circuit_open" and d["attempts"] == 0  # no call made


async def test_a_truncated_answer_is_retried_once_with_a_larger_budget(
    processor: TaskProcessor,
    simulator: SimulatorServer,
    tmp_path: Path,
    make_processor: MakeProcessor,
) -> None:
    import shutil

    pipeline = (ROOT / "pipelines" / "comment-analysis.yaml").read_text()
    (tmp_path / "p").mkdir()
    # Answers here take ~45 tokens: 36 cuts them; 36 x 1.5 = 54 fits.
    (tmp_path / "p" / "c.yaml").write_text(pipeline.replace("max_tokens: 400", "max_tokens: 36"))
    shutil.copytree(ROOT / "schemas", tmp_path / "s")
    registry = PipelineRegistry.load(tmp_path / "p", tmp_path / "s")
    processor = make_processor(guarded=processor.client, registry=registry)
    seen: list[int] = []
    original = processor.client.client.complete

    async def spy(request):  # type: ignore[no-untyped-def]
        seen.append(request.params["max_tokens"])
        return await original(request)

    processor.client.client.complete = spy  # type: ignore[method-assign]
    out = await processor.process(_task("Arrived late, box crushed."), b"t1", SRC)
    assert seen == [36, 54]
    assert out.kind == "result", orjson.loads(out.value)
    assert simulator.sim.snapshot()["by_outcome"]["truncated"] == 1
    # Now 1.5x does not fit: the budget stops at what the window leaves (40 tokens).
    text = "Arrived late, box crushed. Works great."
    version = processor.registry.get("comment-analysis").version(None, "t2")
    prompt_tokens = count_messages(version.render({"text": text}, "sim-1").messages)
    processor = make_processor(
        guarded=processor.client, registry=registry,
        context_window=math.ceil((prompt_tokens + 40) / WINDOW_SHARE),
    )  # fmt: skip
    seen.clear()
    out = await processor.process(_task(text), b"t2", SRC)
    assert len(seen) == 2, orjson.loads(out.value)
    assert seen[0] == 36 and seen[1] == int(processor.config.context_window * WINDOW_SHARE) - (
        prompt_tokens
    )
    assert seen[1] < 54
    assert out.kind == "dead_letter" and out.category == "invalid_output"


async def test_context_overflow_truncates_the_slot_and_retries_once(
    processor: TaskProcessor,
    simulator: SimulatorServer,
    tmp_path: Path,
    make_processor: MakeProcessor,
) -> None:
    # The version's truncation, alone.
    processor = make_processor(guarded=processor.client, registry=_without_chunking(tmp_path))
    simulator.sim.config.context_window = 1000  # system prompt + 400 completion leave ~400
    words = " ".join(f"The blender part {i} was fine." for i in range(220))  # ~1,800 tokens
    text = "Arrived late. " + words
    assert len(text) < 8000  # within the slot's max_length: only the window is too small
    out = await processor.process(_task(text), b"t1", SRC)
    assert out.kind == "result", orjson.loads(out.value)
    r = orjson.loads(out.value)
    assert r["attempts"] == 2  # the refused call, then the shortened one
    # The key stays the task's own (computed from the input as sent, not the cut one).
    assert out.key == result_key("comment-analysis", "v1", "t1", {"text": text})
    stats = simulator.sim.snapshot()
    assert stats["by_outcome"] == {"context_overflow": 1, "ok": 1}


@pytest.mark.parametrize("words", [0, 120])
async def test_an_overflow_of_the_answers_budget_alone_cuts_the_budget_not_the_input(
    processor: TaskProcessor,
    simulator: SimulatorServer,
    tmp_path: Path,
    make_processor: MakeProcessor,
    words: int,
) -> None:
    """vLLM refuses a prompt that fits its window when the prompt and `max_tokens` together
    do not. The refusal teaches the window; the task was then answered on its input cut by
    the whole excess (a long comment lost what the budget was over) or, a short one, was a
    `context_overflow_unmitigated` dead letter — where the budget alone had to shrink."""
    processor = make_processor(guarded=processor.client, registry=_without_chunking(tmp_path))
    text = "Arrived late, box crushed. " + " ".join(f"Part {i} was fine." for i in range(words))
    version = processor.registry.get("comment-analysis").version(None, "t1")
    prompt_tokens = count_messages(version.render({"text": text}, "sim-1").messages)
    # The prompt fits with room for an answer; with the pipeline's 400 tokens it does not.
    simulator.sim.config.context_window = math.ceil((prompt_tokens + 100) / WINDOW_SHARE)
    assert prompt_tokens + 400 > simulator.sim.config.context_window
    sent: list[tuple[str, int]] = []
    original = processor.client.client.complete

    async def spy(request):  # type: ignore[no-untyped-def]
        sent.append((request.messages[-1]["content"], request.params["max_tokens"]))
        return await original(request)

    processor.client.client.complete = spy  # type: ignore[method-assign]
    out = await processor.process(_task(text), b"t1", SRC)
    assert out.kind == "result", orjson.loads(out.value)
    assert simulator.sim.snapshot()["by_outcome"] == {"context_overflow": 1, "ok": 1}
    (first, asked), (second, budget) = sent
    assert asked == 400 and budget < 400  # the budget cut to what the window leaves
    assert second == first and text.strip() in second  # the input as it came
    assert processor.metrics.mitigations.labels("comment-analysis", "truncate")._value.get() == 0


async def test_context_overflow_that_no_cut_can_fix_is_dead_lettered(
    processor: TaskProcessor,
    simulator: SimulatorServer,
    tmp_path: Path,
    make_processor: MakeProcessor,
) -> None:
    processor = make_processor(guarded=processor.client, registry=_without_chunking(tmp_path))
    simulator.sim.config.context_window = 300  # smaller than the system prompt + budget
    out = await processor.process(_task("Fine. " * 100), b"t1", SRC)
    assert out.kind == "dead_letter"
    error = orjson.loads(out.value)["error"]
    assert error["category"] == "context_overflow"
    assert error["code"] == "context_overflow_unmitigated"
    assert "cannot make it fit" in error["message"]
    assert simulator.sim.snapshot()["requests"] == 1  # no second call was made


async def test_context_overflow_without_a_policy_is_dead_lettered_at_once(
    simulator: SimulatorServer, tmp_path: Path, make_processor: MakeProcessor
) -> None:
    spec = (ROOT / "pipelines" / "comment-analysis.yaml").read_text()
    policy = "    on_context_overflow: {strategy: truncate, slot: text, keep: head}\n"
    assert policy in spec
    spec = spec[: spec.index("chunking:")] + spec[spec.index("versions:") :]  # nor chunks
    (tmp_path / "comment-analysis.yaml").write_text(spec.replace(policy, ""))
    simulator.sim.config.context_window = 1000
    client = OpenAIClient(
        base_url=simulator.base_url, api_key="k", connect_timeout_s=1, read_timeout_s=2
    )
    processor = make_processor(
        client, registry=PipelineRegistry.load(tmp_path, ROOT / "schemas"),
        limiter=RateLimiter(rpm=None), breaker=CircuitBreaker("sim"),
        policy=RetryPolicy(max_attempts=3),
    )  # fmt: skip
    try:
        out = await processor.process(_task("Too long. " * 700), b"t1", SRC)
    finally:
        await client.close()
    assert out.kind == "dead_letter"
    error = orjson.loads(out.value)["error"]
    assert (error["category"], error["code"]) == ("context_overflow", "context_length_exceeded")
    assert simulator.sim.snapshot()["requests"] == 1


def _without_chunking(tmp_path: Path) -> PipelineRegistry:
    """comment-analysis as it would be without its chunking block."""
    spec = (ROOT / "pipelines" / "comment-analysis.yaml").read_text()
    start = spec.index("chunking:")
    end = spec.index("versions:")
    (tmp_path / "comment-analysis.yaml").write_text(spec[:start] + spec[end:])
    registry = PipelineRegistry.load(tmp_path, ROOT / "schemas")
    assert registry.get("comment-analysis").spec.chunking is None
    return registry


def _spy(processor: TaskProcessor) -> list[Any]:
    """Requests the processor sends, in order."""
    sent: list[Any] = []
    original = processor.client.client.complete

    async def spy(request):  # type: ignore[no-untyped-def]
        sent.append(request)
        return await original(request)

    processor.client.client.complete = spy  # type: ignore[method-assign]
    return sent


async def test_the_answer_budget_is_cut_to_what_the_context_window_leaves(
    processor: TaskProcessor, tmp_path: Path, make_processor: MakeProcessor
) -> None:
    processor = make_processor(  # 85% of 1,400 = 1,190 for prompt + answer
        guarded=processor.client, registry=_without_chunking(tmp_path), context_window=1400
    )
    sent = _spy(processor)
    text = "Arrived late. " + " ".join(f"Part {i} was fine." for i in range(120))
    out = await processor.process(_task(text), b"t1", SRC)
    assert out.kind == "result", orjson.loads(out.value)
    (request,) = sent
    room = int(1400 * WINDOW_SHARE) - count_messages(request.messages)
    assert 0 < room < 400  # the pipeline asks for 400; the window leaves less
    assert request.params["max_tokens"] == room


async def test_a_short_prompt_keeps_its_budget_without_counting_tokens(
    processor: TaskProcessor, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent = _spy(processor)

    def no_count(messages: Any) -> int:
        raise AssertionError("counted tokens for a prompt far from the window's edge")

    monkeypatch.setattr("streams.core.window.count_messages", no_count)
    out = await processor.process(_task(), b"t1", SRC)
    assert out.kind == "result" and sent[0].params["max_tokens"] == 400


async def test_a_prompt_over_the_window_is_shortened_before_any_call(
    processor: TaskProcessor,
    simulator: SimulatorServer,
    tmp_path: Path,
    make_processor: MakeProcessor,
) -> None:
    processor = make_processor(  # (with chunking, the input would be chunked)
        guarded=processor.client, registry=_without_chunking(tmp_path),
        context_window=1000,  # the simulator's own window stays large
    )  # fmt: skip
    words = " ".join(f"The blender part {i} was fine." for i in range(220))  # ~1,800 tokens
    out = await processor.process(_task("Arrived late. " + words), b"t1", SRC)
    assert out.kind == "result", orjson.loads(out.value)
    # Our own count caught it: no call refused by the provider, one call made.
    assert simulator.sim.snapshot()["by_outcome"] == {"ok": 1}
    assert orjson.loads(out.value)["attempts"] == 1


async def test_the_repair_token_cap_stops_a_repair(
    simulator: SimulatorServer, tmp_path: Path, make_processor: MakeProcessor
) -> None:
    spec = (ROOT / "pipelines" / "comment-analysis.yaml").read_text()
    (tmp_path / "comment-analysis.yaml").write_text(
        spec.replace("quote_source: text\n", "quote_source: text\nrepair_token_cap: 300\n")
    )
    client = OpenAIClient(
        base_url=simulator.base_url, api_key="k", connect_timeout_s=1, read_timeout_s=2
    )
    processor = make_processor(
        client, registry=PipelineRegistry.load(tmp_path, ROOT / "schemas"),
        limiter=RateLimiter(rpm=None), breaker=CircuitBreaker("sim"),
        policy=RetryPolicy(max_attempts=3),
    )  # fmt: skip
    simulator.sim.config.malformed_rate = 1.0
    try:
        out = await processor.process(_task(), b"t1", SRC)
    finally:
        await client.close()
    assert out.kind == "dead_letter"
    letter = orjson.loads(out.value)
    assert letter["error"]["category"] == "invalid_output"
    assert letter["error"]["code"] == "repair_token_cap"
    assert "cap 300" in letter["error"]["message"] and "not JSON" in letter["error"]["message"]
    # The first answer was the only call: the repair (~700 tokens) would pass the cap.
    assert simulator.sim.snapshot()["requests"] == 1 and letter["attempts"] == 1


async def test_a_window_an_overflow_says_is_learned_and_the_input_chunked_to_it(
    processor: TaskProcessor, simulator: SimulatorServer
) -> None:
    """Nobody told the worker the model's window (the simulator plays a server that says
    it only when it refuses): the first long comment is refused, its refusal's numbers
    set the window, and the comment is answered in chunks of it, as it would have been
    with the window known — not dead-lettered, not cut. The next one is chunked at once."""
    simulator.sim.config.context_window = 1200
    words = " ".join(f"The blender part {i} was fine." for i in range(220))  # ~1,800 tokens
    out = await processor.process(_task("Arrived late. " + words), b"t1", SRC)
    assert out.kind == "result", orjson.loads(out.value)
    assert processor.client.window.source == "overflow"
    assert processor.client.window.server_tokens == 1200
    stats = simulator.sim.snapshot()
    assert stats["by_outcome"]["context_overflow"] == 1 and stats["by_outcome"]["ok"] >= 2
    again = await processor.process(_task("Late again. " + words), b"t2", SRC)
    assert again.kind == "result"
    assert simulator.sim.snapshot()["by_outcome"]["context_overflow"] == 1  # no second refusal


async def test_prompt_tokens_read_from_the_providers_cache_are_priced_and_recorded(
    simulator: SimulatorServer, make_processor: MakeProcessor
) -> None:
    simulator.sim.config.prompt_cache_min_tokens = 1  # the system prompt, once seen
    client = OpenAIClient(base_url=simulator.base_url, api_key="k", connect_timeout_s=1,
                          read_timeout_s=5)  # fmt: skip
    metrics = Metrics()
    guarded = GuardedClient(client, limiter=RateLimiter(rpm=1_000_000),
                            breaker=CircuitBreaker("sim", min_calls=1000), metrics=metrics)  # fmt: skip
    processor = make_processor(
        guarded=guarded, metrics=metrics,
        prices=Prices(prompt_per_1k=1.0, completion_per_1k=2.0, cached_prompt_per_1k=0.1),
    )  # fmt: skip
    try:
        first = orjson.loads((await processor.process(_task("Great kettle."), b"t1", SRC)).value)
        second = orjson.loads((await processor.process(
            orjson.dumps({"task_id": "t2", "pipeline": "comment-analysis",
                          "input": {"text": "The lid squeaks."}}), b"t2", SRC)).value)  # fmt: skip
    finally:
        await client.close()
    assert first["usage"]["cached_prompt_tokens"] == 0  # the cache was cold
    usage = second["usage"]
    cached = usage["cached_prompt_tokens"]
    assert 0 < cached < usage["prompt_tokens"]
    assert second["cost_usd"] == pytest.approx(
        ((usage["prompt_tokens"] - cached) * 1.0 + cached * 0.1
         + usage["completion_tokens"] * 2.0) / 1000
    )  # fmt: skip
    tokens = metrics.registry.get_sample_value(
        "llm_streams_tokens_total", {"model": "sim-1", "kind": "cached_prompt"}
    )
    assert tokens == cached


async def test_a_reasoning_models_thinking_before_its_answer_is_read_past(
    processor: TaskProcessor, simulator: SimulatorServer
) -> None:
    """DeepSeek-R1, Qwen3 and QwQ served without a reasoning parser (vLLM without one,
    Ollama, LM Studio) write `<think>…</think>` before the JSON. Every answer was
    `not_json`: a repair paid for, thought through again, and a dead letter."""
    simulator.sim.config.reasoning_in_content = True
    out = await processor.process(_task("Arrived late, box crushed."), b"t1", SRC)
    result = orjson.loads(out.value)
    assert out.kind == "result", result
    assert result["attempts"] == 1 and simulator.sim.snapshot()["requests"] == 1
    assert processor.registry.get("comment-analysis").is_valid(result["output"])
