"""One task's calls against a server that is not OpenAI's (the simulator playing
llama.cpp's): a forced tool call it answers as content is read, counted and said once;
a flex call it does not confirm is priced in full."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from streams.contract.lanes import Lane, Tier
from streams.contract.records import Source
from streams.core.outcome import Prepared
from streams.core.spend import Prices
from streams.dev.simulator import SimulatorServer
from streams.llm.openai_client import OpenAIClient
from streams.pipelines.registry import PipelineRegistry
from tests.conftest import MakeProcessor

ROOT = Path(__file__).resolve().parents[3]
SRC = Source(topic="t", partition=0, offset=1)


def _registry(tmp_path: Path, mode: str) -> PipelineRegistry:
    spec = (ROOT / "pipelines" / "comment-analysis.yaml").read_text()
    (tmp_path / "c.yaml").write_text(spec.replace("response_format: json_schema",
                                                  f"response_format: {mode}"))  # fmt: skip
    return PipelineRegistry.load(tmp_path, ROOT / "schemas")


async def test_a_forced_tool_call_answered_as_content_is_read_counted_and_said_once(
    simulator: SimulatorServer, make_processor: MakeProcessor, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    simulator.sim.config.server = "llama.cpp"  # refuses tool_choice objects
    client = OpenAIClient(base_url=simulator.base_url, api_key="k", connect_timeout_s=1,
                          read_timeout_s=5)  # fmt: skip
    processor = make_processor(client, registry=_registry(tmp_path, "tool_call"))
    try:
        for i in range(3):
            raw = orjson.dumps({"task_id": f"t{i}", "pipeline": "comment-analysis",
                                "input": {"text": f"Great kettle number {i}."}})  # fmt: skip
            out = await processor.process(raw, None, SRC)
            assert out.kind == "result", orjson.loads(out.value)
    finally:
        await client.close()
    counted = processor.metrics.structured_degraded.labels("sim-1", "tool_call", "content")
    assert counted._value.get() == 3
    said = [r for r in caplog.records if "does not honour tool_call" in r.getMessage()]
    assert len(said) == 1


async def test_a_flex_call_the_server_does_not_confirm_is_priced_in_full(
    simulator: SimulatorServer, make_processor: MakeProcessor
) -> None:
    simulator.sim.config.server = "llama.cpp"  # ignores service_tier, never echoes it
    client = OpenAIClient(base_url=simulator.base_url, api_key="k", connect_timeout_s=1,
                          read_timeout_s=5)  # fmt: skip
    processor = make_processor(client, prices=Prices(prompt_per_1k=1.0, completion_per_1k=2.0))
    raw = orjson.dumps({"task_id": "f1", "pipeline": "comment-analysis",
                        "input": {"text": "Works great."}})  # fmt: skip
    try:
        prep = processor.intake.prepare(raw, None, SRC)
        assert isinstance(prep, Prepared)
        out = await processor.answer(prep, Lane.REPLAY, None, Tier.FLEX)
    finally:
        await client.close()
    result = orjson.loads(out.value)
    full = Prices(1.0, 2.0).cost(result["usage"]["prompt_tokens"],
                                 result["usage"]["completion_tokens"])  # fmt: skip
    assert result["cost_usd"] == pytest.approx(full)  # not halved: nothing confirmed it
    assert processor.metrics.discount_unconfirmed.labels("sim-1", "flex")._value.get() == 1


async def test_an_endpoint_that_refuses_json_schema_is_asked_with_the_schema_in_the_prompt(
    simulator: SimulatorServer, make_processor: MakeProcessor, caplog: pytest.LogCaptureFixture
) -> None:
    """llama-cpp-python's server answers json_schema with a 500: the first task's refused
    attempt teaches it, the attempt is asked again with the schema in the prompt, and
    every later task goes that way at once — not a dead letter each, not a breaker."""
    simulator.sim.config.refuses_json_schema = True
    client = OpenAIClient(base_url=simulator.base_url, api_key="k", connect_timeout_s=1,
                          read_timeout_s=5)  # fmt: skip
    processor = make_processor(client)  # the shipped pipeline: json_schema
    try:
        for i in range(3):
            raw = orjson.dumps({"task_id": f"j{i}", "pipeline": "comment-analysis",
                                "input": {"text": f"Broke on day {i + 2}."}})  # fmt: skip
            out = await processor.process(raw, None, SRC)
            assert out.kind == "result", orjson.loads(out.value)
    finally:
        await client.close()
    assert simulator.sim.snapshot()["by_outcome"]["json_schema_refused"] == 1
    counted = processor.metrics.structured_degraded.labels("sim-1", "json_schema",
                                                           "schema_in_prompt")  # fmt: skip
    assert counted._value.get() == 1
    assert sum("does not honour json_schema" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize(
    ("message", "refused"),
    [
        ("Unsupported response_format type: json_schema", True),  # llama-cpp-python (500)
        # llama.cpp's server (400), a schema its grammar cannot be made from:
        (
            "Unable to generate parser for this template. Automatic parser generation failed: "
            "JSON schema error at #/properties/a: unsupported $ref https://example.com/a.json, "
            "only references into the same document are supported",
            True,
        ),
        ("JSON schema conversion failed:\nUnrecognized schema: {}", True),  # older llama.cpp
        # vLLM (400) with guided decoding on xgrammar:
        ("The provided JSON schema contains features not supported by xgrammar.", True),
        ("'messages' must contain the word 'json' in some form", False),  # the task's own
        ("temperature: Input should be less than or equal to 2", False),
    ],
)
def test_a_refusal_of_the_schema_itself_is_told_from_a_refusal_of_the_task(
    message: str, refused: bool
) -> None:
    """A schema the endpoint cannot enforce was each task's bad_request dead letter on
    llama.cpp and vLLM, whose words for it did not say "json_schema"."""
    from streams.core.calls import refuses_json_schema
    from streams.errors import BadRequest, UpstreamError
    from streams.llm.client import LLMRequest

    request = LLMRequest(messages=[{"role": "user", "content": "x"}], model="m",
                         response_format={"type": "json_schema", "json_schema": {}})  # fmt: skip
    for error in (BadRequest(message), UpstreamError(message)):  # a 400, a 500
        assert refuses_json_schema(request, error) is refused


async def test_a_reasoning_model_is_asked_again_without_what_it_refuses(
    simulator: SimulatorServer, make_processor: MakeProcessor, caplog: pytest.LogCaptureFixture
) -> None:
    """OpenAI's reasoning models (o-series, gpt-5) refuse `max_tokens` ("use
    max_completion_tokens") and a temperature other than 1, each with a 400: the shipped
    pipeline (temperature 0, max_tokens 400) was a bad_request dead letter for every task.
    The first refusals teach the model's client; the budget goes as max_completion_tokens,
    the temperature is left to the model, said once each and counted."""
    simulator.sim.config.reasoning_models = ["sim-1"]
    client = OpenAIClient(base_url=simulator.base_url, api_key="k", connect_timeout_s=1,
                          read_timeout_s=5)  # fmt: skip
    processor = make_processor(client)
    sent: list[dict[str, object]] = []
    original = processor.client.client.complete

    async def spy(request):  # type: ignore[no-untyped-def]
        sent.append(dict(request.params))
        return await original(request)

    processor.client.client.complete = spy  # type: ignore[method-assign]
    try:
        for i in range(3):
            raw = orjson.dumps({"task_id": f"r{i}", "pipeline": "comment-analysis",
                                "input": {"text": f"Broke on day {i + 2}."}})  # fmt: skip
            out = await processor.process(raw, None, SRC)
            assert out.kind == "result", orjson.loads(out.value)
    finally:
        await client.close()
    assert simulator.sim.snapshot()["by_outcome"] == {"param_unsupported": 2, "ok": 3}
    assert sent[-1] == {"max_completion_tokens": 400}  # the budget kept, under its new name
    counted = processor.metrics.mitigations.labels
    assert counted("comment-analysis", "param_renamed")._value.get() == 1
    assert counted("comment-analysis", "param_dropped")._value.get() == 1
    said = [r.getMessage() for r in caplog.records if "refuses" in r.getMessage()]
    assert len(said) == 2 and any("max_completion_tokens" in m for m in said)


@pytest.mark.parametrize(
    ("message", "params", "learned"),
    [
        (
            "Unsupported parameter: 'max_tokens' is not supported with this model. Use "
            "'max_completion_tokens' instead.",
            {"max_tokens": 5},
            ("max_tokens", "max_completion_tokens"),
        ),
        (
            "Unsupported value: 'temperature' does not support 0 with this model. Only the "
            "default (1) value is supported.",
            {"temperature": 0},
            ("temperature", None),
        ),
        (
            "Unrecognized request argument supplied: reasoning_effort",
            {"reasoning_effort": "low"},
            ("reasoning_effort", None),
        ),
        (
            "property 'store' is unsupported, did you mean 'stop'?",
            {"store": True},
            ("store", None),
        ),  # Groq
        (
            'Invalid JSON payload received. Unknown name "top_k": Cannot find field.',
            {"top_k": 5, "temperature": 0},
            ("top_k", None),
        ),  # Gemini's OpenAI endpoint
        (
            "Argument not supported: logit_bias",
            {"logit_bias": {"1": 2}},
            ("logit_bias", None),
        ),  # OCI
        # The budget is never left out: refused, it goes under its other name (Azure's API
        # versions before 2024-09 know no max_completion_tokens); a parameter the request
        # does not have is no parameter of ours; nor is another refusal.
        (
            "Unsupported parameter: 'max_tokens' is not supported with this model.",
            {"max_tokens": 5},
            ("max_tokens", "max_completion_tokens"),
        ),
        (
            "Unrecognized request argument supplied: max_completion_tokens",
            {"max_completion_tokens": 5},
            ("max_completion_tokens", "max_tokens"),
        ),
        ("Unsupported value: 'temperature' does not support 0.", {"top_p": 1}, None),
        ("Invalid 'messages[0].content': string too long.", {"temperature": 0}, None),
    ],
)
def test_a_refused_parameter_is_named_with_what_to_send_instead(
    message: str, params: dict[str, object], learned: tuple[str, str | None] | None
) -> None:
    from streams.errors import BadRequest
    from streams.llm.params import PARAM, refused_param, without_refused

    assert refused_param(params, BadRequest(f"HTTP 400: {message}")) == learned
    if learned is not None:
        name, instead = learned
        taken = without_refused({**params, "seed": 7}, {PARAM + name: instead or ""})
        assert name not in taken and taken["seed"] == 7
        assert instead is None or taken[instead] == params[name]


async def test_a_flex_call_to_a_model_without_the_tier_goes_on_at_the_sync_price(
    simulator: SimulatorServer, make_processor: MakeProcessor, caplog: pytest.LogCaptureFixture
) -> None:
    """OpenAI answers a flex call to a model that offers no flex tier with a 400
    ("Unsupported service_tier: flex"): every flex-tier task (a replay asked at the flex
    price) was a bad_request dead letter. It goes on as a plain call, priced in full, and
    the model's later flex tasks are called plainly at once."""
    simulator.sim.config.flex_refused_models = ["sim-1"]
    client = OpenAIClient(base_url=simulator.base_url, api_key="k", connect_timeout_s=1,
                          read_timeout_s=5)  # fmt: skip
    processor = make_processor(client, prices=Prices(prompt_per_1k=1.0, completion_per_1k=2.0))
    outs = []
    try:
        for i in range(3):
            raw = orjson.dumps({"task_id": f"f{i}", "pipeline": "comment-analysis",
                                "input": {"text": f"Works great, day {i}."}})  # fmt: skip
            prep = processor.intake.prepare(raw, None, SRC)
            assert isinstance(prep, Prepared)
            outs.append(await processor.answer(prep, Lane.REPLAY, None, Tier.FLEX))
    finally:
        await client.close()
    for out in outs:
        result = orjson.loads(out.value)
        assert out.kind == "result", result
        full = Prices(1.0, 2.0).cost(result["usage"]["prompt_tokens"],
                                     result["usage"]["completion_tokens"])  # fmt: skip
        assert result["cost_usd"] == pytest.approx(full)
    assert orjson.loads(outs[0].value)["attempts"] == 2  # the refused flex call, then plain
    assert simulator.sim.snapshot()["by_outcome"] == {"flex_refused": 1, "ok": 3}
    assert processor.metrics.mitigations.labels("*", "flex_fallback")._value.get() == 3
    assert sum("offers no flex tier" in r.getMessage() for r in caplog.records) == 1


async def test_a_budget_refused_under_both_names_is_the_tasks_bad_request_at_once(
    make_processor: MakeProcessor,
) -> None:
    """Learned refusals end: a model refusing max_tokens ("use max_completion_tokens")
    and then max_completion_tokens too is not asked again and again until the deadline."""
    from streams.errors import BadRequest
    from tests.fakes import FakeLLM

    def refuse(request):  # type: ignore[no-untyped-def]
        if "max_tokens" in request.params:
            return BadRequest("HTTP 400: Unsupported parameter: 'max_tokens' is not supported "
                              "with this model. Use 'max_completion_tokens' instead.")  # fmt: skip
        return BadRequest("HTTP 400: Unrecognized request argument supplied: "
                          "max_completion_tokens")  # fmt: skip

    llm = FakeLLM(refuse)
    processor = make_processor(llm)
    raw = orjson.dumps({"task_id": "b1", "pipeline": "comment-analysis",
                        "input": {"text": "Broke on day two."}})  # fmt: skip
    out = await processor.process(raw, None, SRC)
    assert out.kind == "dead_letter" and out.category == "bad_request"
    assert len(llm.requests) == 2


async def test_refusals_of_requests_made_before_one_was_learned_are_asked_again_too(
    make_processor: MakeProcessor,
) -> None:
    """Tasks in flight when the first refusal is learned were sent with the parameter:
    theirs are asked again as well (not taken for a dead end), counted once."""
    import asyncio

    from streams.errors import BadRequest
    from tests.fakes import FakeLLM, answer

    good = {"sentiment": "negative", "confidence": 0.8, "topics": ["quality"], "issues": [],
            "summary": "Broke.", "language": "en"}  # fmt: skip
    gate = asyncio.Event()

    def refuse(request):  # type: ignore[no-untyped-def]
        if "max_tokens" not in request.params:
            return answer(good)
        if not gate.is_set():
            return None  # held until all are in flight
        return BadRequest("HTTP 400: Unsupported parameter: 'max_tokens' is not supported "
                          "with this model. Use 'max_completion_tokens' instead.")  # fmt: skip

    llm = FakeLLM(refuse)
    processor = make_processor(llm)
    raws = [orjson.dumps({"task_id": f"c{i}", "pipeline": "comment-analysis",
                          "input": {"text": f"Broke on day {i + 2}."}}) for i in range(3)]  # fmt: skip
    running = [asyncio.create_task(processor.process(r, None, SRC)) for r in raws]
    await llm.called(3)
    gate.set()
    llm.release()
    outs = await asyncio.gather(*running)
    assert [o.kind for o in outs] == ["result"] * 3, [o.value for o in outs]
    counted = processor.metrics.mitigations.labels("comment-analysis", "param_renamed")
    assert counted._value.get() == 1
