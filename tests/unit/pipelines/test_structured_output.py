"""Structured output for endpoints that ignore `response_format`: the schema asked for
through a forced function call (`tool_call`) or in the prompt (`schema_in_prompt`),
against the simulator playing such an endpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import orjson
import pytest

from streams.contract.records import Source
from streams.core.processor import TaskProcessor
from streams.dev.simulator import SimulatorServer
from streams.llm.client import SCHEMA_IN_PROMPT, LLMRequest, parse_completion, request_body
from streams.llm.openai_client import OpenAIClient
from streams.pipelines.registry import PipelineRegistry
from streams.pipelines.structured import strict_dropped, strict_subset_issues, strict_view
from tests.conftest import MakeProcessor

ROOT = Path(__file__).resolve().parents[3]
SRC = Source(topic="t", partition=0, offset=1)
TASK = orjson.dumps({"task_id": "s1", "pipeline": "comment-analysis",
                     "input": {"text": "The zip broke after two days. Refund please."}})  # fmt: skip


def _registry(tmp_path: Path, mode: str) -> PipelineRegistry:
    text = (ROOT / "pipelines" / "comment-analysis.yaml").read_text()
    assert "    response_format: json_schema\n" in text
    (tmp_path / "p").mkdir(parents=True)
    (tmp_path / "p" / "c.yaml").write_text(
        text.replace("    response_format: json_schema\n", f"    response_format: {mode}\n")
    )
    shutil.copytree(ROOT / "schemas", tmp_path / "s")
    return PipelineRegistry.load(tmp_path / "p", tmp_path / "s")


def test_each_mode_asks_for_the_output_schema_its_own_way(tmp_path: Path) -> None:
    schema = None
    asked = {}
    for mode in ("json_schema", "json_object", "schema_in_prompt", "tool_call"):
        registry = _registry(tmp_path / mode, mode)
        pipeline = registry.get("comment-analysis")
        schema = pipeline.output_schema
        prompt = pipeline.versions["v1"].render({"text": "Fine."}, "sim-1")
        request = LLMRequest(prompt.messages, prompt.model, prompt.params,
                             prompt.response_format, prompt.tool)  # fmt: skip
        asked[mode] = (request_body(request), prompt.messages[0]["content"])
    sent = strict_view(schema)  # what strict mode takes of it; the rest is checked here
    assert "uniqueItems" in schema["properties"]["topics"]  # type: ignore[index]
    assert "uniqueItems" not in sent["properties"]["topics"]
    assert sent["properties"]["topics"]["maxItems"] == 7  # bounded: no endless repetition
    body, system = asked["json_schema"]
    assert body["response_format"]["json_schema"]["schema"] == sent and "tools" not in body
    body, system = asked["tool_call"]
    assert "response_format" not in body
    assert body["tools"][0]["function"]["parameters"] == sent
    assert body["tool_choice"] == {
        "type": "function",
        "function": {"name": body["tools"][0]["function"]["name"]},
    }
    body, system = asked["schema_in_prompt"]
    assert body["response_format"] == {"type": "json_object"}
    assert orjson.loads(system.split(SCHEMA_IN_PROMPT, 1)[1]) == schema
    body, system = asked["json_object"]
    assert body["response_format"] == {"type": "json_object"} and SCHEMA_IN_PROMPT not in system


def test_the_answer_of_a_forced_function_call_is_its_arguments() -> None:
    raw = orjson.dumps({"model": "m", "choices": [{"finish_reason": "tool_calls", "message": {
        "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "comment_analysis", "arguments": '{"sentiment": "negative"}'}}]}}]})  # fmt: skip
    assert orjson.loads(parse_completion(raw, "m").content) == {"sentiment": "negative"}


async def _answer(
    simulator: SimulatorServer, registry: PipelineRegistry, make_processor: MakeProcessor
) -> dict[str, object]:
    client = OpenAIClient(base_url=simulator.base_url, api_key="k", connect_timeout_s=2,
                          read_timeout_s=5)  # fmt: skip
    processor: TaskProcessor = make_processor(client, registry=registry)
    try:
        outcome = await processor.process(TASK, None, SRC)
        return {"kind": outcome.kind, **orjson.loads(outcome.value)}
    finally:
        await processor.close()


@pytest.mark.parametrize("mode", ["tool_call", "schema_in_prompt"])
async def test_an_endpoint_that_ignores_response_format_still_answers_in_the_schema(
    simulator: SimulatorServer, tmp_path: Path, make_processor: MakeProcessor, mode: str
) -> None:
    simulator.sim.config.ignores_response_format = True
    # json_schema against it: prose comes back, every attempt fails validation.
    plain = await _answer(simulator, _registry(tmp_path / "plain", "json_schema"), make_processor)
    assert plain["kind"] == "dead_letter"
    assert plain["error"]["category"] == "invalid_output"  # type: ignore[index]
    got = await _answer(simulator, _registry(tmp_path / mode, mode), make_processor)
    assert got["kind"] == "result", got
    assert got["output"]["sentiment"] == "negative"  # type: ignore[index]


def test_validate_names_what_leaves_the_strict_mode_subset() -> None:
    clean = {"type": "object", "additionalProperties": False, "required": ["a"],
             "properties": {"a": {"type": "string", "enum": ["x", "y"]}}}  # fmt: skip
    assert strict_subset_issues(clean) == []
    loose = {"type": "object", "required": ["a"], "properties": {
        "a": {"type": "string", "minLength": 1},
        "b": {"oneOf": [{"type": "integer"}, {"type": "null"}]}}}  # fmt: skip
    issues = strict_subset_issues(loose)
    assert any("additionalProperties: false" in i for i in issues)
    assert any("every property required (['b'])" in i for i in issues)
    assert any("#/properties/b: `oneOf`" in i for i in issues)  # it shapes the answer
    assert not any("minLength" in i for i in issues)  # it narrows: left out, checked here
    assert strict_dropped(loose) == ["#/properties/a: `minLength`"]
    assert strict_view(loose)["properties"] == {"a": {"type": "string"}, "b": {}}


def test_pipelines_validate_notes_what_a_strict_request_leaves_out_and_passes_the_shipped() -> None:
    from click.testing import CliRunner

    from streams.cli import cli

    run = CliRunner().invoke(cli, ["pipelines", "validate", "--dir", str(ROOT / "pipelines")])
    assert run.exit_code == 0, run.output
    assert "ok  comment-analysis" in run.output
    assert "warn" not in run.output  # the shipped pipelines pass their own lint
    assert "note comment-analysis" in run.output and "#/properties/summary: `maxLength`" in (
        run.output
    )


async def test_validate_endpoint_says_what_the_endpoint_is_and_honours() -> None:
    """Against a server playing llama.cpp's: its window and slots, json_schema honoured,
    a forced tool call (object or "required") answered as text."""
    import asyncio
    import os
    import sys

    from streams.dev.simulator import SimConfig

    server = SimulatorServer(SimConfig(server="llama.cpp", max_concurrency=2,
                                       context_window=2048, api_key="k"))  # fmt: skip
    await server.start()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_STREAMS_")}
        env.update(OPENAI_BASE_URL=server.base_url, OPENAI_API_KEY="k",
                   LLM_STREAMS_LLM__MODEL="sim-1")  # fmt: skip
        run = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "streams.cli", "pipelines", "validate", "--endpoint", env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out = (await asyncio.wait_for(run.communicate(), 120))[0].decode()
    finally:
        await server.stop()
    assert run.returncode == 0, out
    assert "server llama.cpp, window 2048, slots 2" in out
    assert "json_schema: honoured" in out
    assert "tool_call (object): answered as text" in out
    assert "tool_call (required): answered as text" in out


async def test_validate_endpoint_asks_a_reasoning_model_as_it_takes_it() -> None:
    """The tries asked `max_tokens` and temperature 0: a reasoning model (o-series, gpt-5)
    refused each, and the report said json_schema "refused" where the worker — which
    learns those refusals — gets its answers."""
    from streams.dev.simulator import SimConfig
    from streams.llm.openai_client import REASONING_BUDGET, OpenAIClient

    server = SimulatorServer(SimConfig(reasoning_models=["sim-1"]))
    await server.start()
    client = OpenAIClient(base_url=server.base_url, api_key="k", connect_timeout_s=1,
                          read_timeout_s=5)  # fmt: skip
    bodies: list[dict[str, object]] = []
    original = client.complete_raw

    async def spy(body, timeout_s):  # type: ignore[no-untyped-def]
        bodies.append(body)
        return await original(body, timeout_s)

    client.complete_raw = spy  # type: ignore[method-assign]
    try:
        tried = await client.structured_support("sim-1")
    finally:
        await client.close()
        await server.stop()
    assert tried["json_schema"] == "honoured", tried
    assert not any(v.startswith("refused") for v in tried.values()), tried
    assert server.sim.snapshot()["by_outcome"]["param_unsupported"] == 2  # learned once
    last = bodies[-1]
    assert last["max_completion_tokens"] == REASONING_BUDGET and "temperature" not in last
