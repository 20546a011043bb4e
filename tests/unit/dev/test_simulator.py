from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import pytest

from streams.dev import sim_content
from streams.dev.simulator import SimulatorServer

ROOT = Path(__file__).resolve().parents[3]
SCHEMA = json.loads((ROOT / "schemas" / "comment-analysis.output.schema.json").read_text())


def _body(text: str, fmt: dict | None = None, max_tokens: int = 100) -> dict:
    body = {"model": "sim-1", "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": "analyse"},
                         {"role": "user", "content": f"<comment>{text}</comment>"}]}  # fmt: skip
    if fmt:
        body["response_format"] = fmt
    return body


async def _post(
    sim: SimulatorServer, body: dict, headers: dict | None = None
) -> tuple[int, Any, dict]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{sim.base_url}/chat/completions", json=body, headers=headers or {}) as r,
    ):
        return r.status, r.headers.copy(), await r.json()  # case-insensitive, like HTTP


@pytest.mark.parametrize(
    ("text", "label"),
    [
        ("I love it, excellent quality!", "positive"),
        ("Terrible. Broke after two days.", "negative"),
        ("Arrived late but works great.", "mixed"),
        ("It is a lamp.", "neutral"),
        ("质量很好，非常满意！", "positive"),
        ("快递太慢了，很失望。", "negative"),
        ("Not good at all.", "negative"),
    ],
)
def test_sentiment_is_deterministic_from_the_text(text: str, label: str) -> None:
    assert sim_content.sentiment(text) == label
    first = sim_content.instance(SCHEMA, text)
    assert first == sim_content.instance(SCHEMA, text)
    jsonschema.validate(first, SCHEMA)
    assert first["sentiment"] == label
    for issue in first["issues"]:
        assert issue["evidence"] in text


def test_instance_of_an_arbitrary_schema_is_valid() -> None:
    schema = {
        "type": "object", "required": ["a", "b", "c", "d", "e"], "additionalProperties": False,
        "$defs": {"tag": {"type": "string", "enum": ["x", "y"]}},
        "properties": {
            "a": {"type": "integer", "minimum": 3, "maximum": 9},
            "b": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "minItems": 1},
            "c": {"type": "string", "minLength": 5, "maxLength": 6},
            "d": {"type": ["boolean", "null"]},
            "e": {"type": "object", "properties": {"f": {"const": 1}}, "required": ["f"]},
        },
    }  # fmt: skip
    jsonschema.validate(sim_content.instance(schema, "some text"), schema)


async def test_json_schema_answers_are_valid_with_usage(simulator: SimulatorServer) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    status, _, body = await _post(simulator, _body("Great product, fast delivery", fmt))
    assert status == 200
    content = json.loads(body["choices"][0]["message"]["content"])
    jsonschema.validate(content, SCHEMA)
    assert content["sentiment"] == "positive"
    assert body["usage"]["prompt_tokens"] > 10 and body["usage"]["completion_tokens"] > 0
    status, _, body = await _post(simulator, _body("Great", {"type": "json_object"}))
    assert json.loads(body["choices"][0]["message"]["content"])["sentiment"] == "positive"


async def test_rate_limit_answers_429_with_openai_headers(simulator: SimulatorServer) -> None:
    simulator.sim.config.rpm = 60  # one request per second, no burst of 60
    first = await _post(simulator, _body("a"))
    assert first[0] == 200
    assert first[1]["x-ratelimit-limit-requests"] == "60"
    assert "x-ratelimit-remaining-requests" in first[1] and "x-ratelimit-reset-requests" in first[1]
    status, headers, body = await _post(simulator, _body("b"))
    assert status == 429
    assert body["error"]["code"] == "rate_limit_exceeded"
    assert 0 < float(headers["retry-after-ms"]) <= 1000 and headers["retry-after"] == "1"
    assert simulator.sim.snapshot()["by_status"] == {"200": 1, "429": 1}


async def test_remaining_is_counted_against_the_minute_or_the_enforcing_window(
    simulator: SimulatorServer,
) -> None:
    simulator.sim.config.rpm = 3000  # 50 a second, bursts of one second
    minute = int((await _post(simulator, _body("a")))[1]["x-ratelimit-remaining-requests"])
    simulator.sim.config.remaining_window_s = 1.0
    second = int((await _post(simulator, _body("b")))[1]["x-ratelimit-remaining-requests"])
    assert 2900 <= minute <= 2950  # OpenAI's way: the share of the minute's 3000 left
    assert 46 <= second <= 48  # the second that enforces: 50 less the two calls


async def test_a_provider_without_rate_headers_refuses_with_retry_after_alone(
    simulator: SimulatorServer,
) -> None:
    simulator.sim.config.update({"rpm": 60, "rate_headers": False})  # one a second
    status, headers, _ = await _post(simulator, _body("a"))
    assert status == 200 and not any(k.startswith("x-ratelimit-") for k in headers)
    status, headers, _ = await _post(simulator, _body("b"))
    assert status == 429 and float(headers["retry-after-ms"]) > 0
    assert not any(k.startswith("x-ratelimit-") for k in headers)


async def test_a_fixed_window_admits_its_budget_then_refuses_until_it_ends(
    simulator: SimulatorServer,
) -> None:
    simulator.sim.config.update({"rpm": 180, "limit_shape": "window", "window_s": 1.0})
    statuses = [(await _post(simulator, _body(str(i))))[0] for i in range(4)]
    assert statuses == [200, 200, 200, 429]  # 180/min over a 1 s window: 3 per window
    status, headers, _ = await _post(simulator, _body("x"))
    assert status == 429 and int(headers["x-ratelimit-remaining-requests"]) == 0
    reset_ms = float(headers["retry-after-ms"])
    assert 0 < reset_ms <= 1000  # until the window ends, not a refill per request
    await asyncio.sleep(reset_ms / 1000 + 0.05)
    assert (await _post(simulator, _body("y")))[0] == 200


async def test_token_limit_answers_429(simulator: SimulatorServer) -> None:
    simulator.sim.config.tpm = 6000  # 100 tokens per second
    assert (await _post(simulator, _body("a", max_tokens=90)))[0] == 200
    status, headers, body = await _post(simulator, _body("b", max_tokens=90))
    assert status == 429 and body["error"]["type"] == "tokens"
    assert headers["x-ratelimit-limit-tokens"] == "6000"


async def test_api_key_is_checked(simulator: SimulatorServer) -> None:
    simulator.sim.config.api_key = "secret"
    status, _, body = await _post(simulator, _body("a"), {"Authorization": "Bearer wrong"})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, _, _ = await _post(simulator, _body("a"), {"Authorization": "Bearer secret"})
    assert status == 200


async def test_context_window_overflow_is_a_400(simulator: SimulatorServer) -> None:
    simulator.sim.config.context_window = 50
    status, _, body = await _post(simulator, _body("x " * 100, max_tokens=10))
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"


async def test_fault_rates_and_duplicates_are_counted(simulator: SimulatorServer) -> None:
    cfg = simulator.sim.config
    cfg.error_500_rate = 1.0
    assert (await _post(simulator, _body("a")))[0] == 500
    cfg.error_500_rate, cfg.error_503_rate = 0.0, 1.0
    assert (await _post(simulator, _body("a")))[0] == 503
    cfg.error_503_rate, cfg.malformed_rate = 0.0, 1.0
    _, _, body = await _post(simulator, _body("a", {"type": "json_object"}))
    with pytest.raises(json.JSONDecodeError):
        json.loads(body["choices"][0]["message"]["content"])
    cfg.malformed_rate = 0.0
    await _post(simulator, _body("a"))
    stats = simulator.sim.snapshot()
    assert stats["by_status"] == {"200": 2, "500": 1, "503": 1}
    assert stats["duplicate_successes"] == 1  # the same prompt answered twice
    assert stats["by_outcome"]["malformed"] == 1


async def test_config_and_stats_endpoints(simulator: SimulatorServer) -> None:
    async with aiohttp.ClientSession() as s:
        root = simulator.base_url.removesuffix("/v1")
        async with s.post(f"{root}/sim/config", json={"rpm": 123}) as r:
            assert r.status == 200 and (await r.json())["rpm"] == 123
        async with s.post(f"{root}/sim/config", json={"nope": 1}) as r:
            assert r.status == 400
        async with s.get(f"{simulator.base_url}/models") as r:
            assert "sim-1" in [m["id"] for m in (await r.json())["data"]]
        async with s.get(f"{root}/sim/stats") as r:
            assert (await r.json())["requests"] == 0


async def test_a_reset_starts_the_limits_afresh(simulator: SimulatorServer) -> None:
    """A bench phase after `/sim/reset` finds full buckets, not the last phase's debt."""
    simulator.sim.config.rpm = 60  # a bucket of one
    assert (await _post(simulator, _body("a")))[0] == 200
    assert (await _post(simulator, _body("b")))[0] == 429
    async with aiohttp.ClientSession() as s:
        root = simulator.base_url.removesuffix("/v1")
        async with s.post(f"{root}/sim/reset") as r:
            assert r.status == 200
    assert (await _post(simulator, _body("c")))[0] == 200


async def test_an_answer_says_the_endpoints_own_time_as_openai_does(
    simulator: SimulatorServer,
) -> None:
    """`openai-processing-ms` on every answer (llama.cpp's server sends none), and its
    spread in the stats: what a benchmark takes off as the endpoint's own time, its
    configured latency and its work beyond it."""
    simulator.sim.config.latency_ms, simulator.sim.config.latency_dist = 40, "fixed"
    status, headers, _ = await _post(simulator, _body("The strap broke."))
    assert status == 200 and int(headers["openai-processing-ms"]) >= 40
    own = simulator.sim.snapshot()["service_ms"]
    assert own["n"] == 1 and own["p50"] >= 40 and own["p99"] >= own["p50"]
    simulator.sim.config.server = "llama.cpp"
    status, headers, _ = await _post(simulator, _body("The strap broke again."))
    assert status == 200 and "openai-processing-ms" not in headers
    assert simulator.sim.snapshot()["service_ms"]["n"] == 2


def test_one_percentile_rule_nearest_rank() -> None:
    from streams.dev.simulator import percentile

    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 0.5) == 51.0 and percentile(values, 0.99) == 100.0
    assert percentile([7.0], 0.99) == 7.0 and percentile([], 0.5) == 0.0


async def test_the_prompts_remembered_for_duplicates_are_bounded_and_counted_through(
    simulator: SimulatorServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A simulator left running forgets the oldest prompts: its memory stays bounded, its
    counts go on, and a duplicate is one answered again while still remembered."""
    monkeypatch.setattr("streams.dev.simulator.REMEMBERED_PROMPTS", 3)
    for text in ("a", "b", "c", "d"):  # "a" is forgotten when "d" comes
        assert (await _post(simulator, _body(text)))[0] == 200
    assert (await _post(simulator, _body("c")))[0] == 200  # remembered: a duplicate
    assert (await _post(simulator, _body("a")))[0] == 200  # forgotten: counted as new
    stats = simulator.sim.snapshot()
    assert len(simulator.sim.answered) == 3
    assert stats["successful_prompts"] == 5
    assert stats["duplicate_successes"] == 1
