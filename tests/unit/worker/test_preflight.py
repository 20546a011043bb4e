"""The LLM endpoint checked before the worker starts: a wrong host or key is one line
naming the setting, at once; an endpoint merely away is waited for, then given up on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml

from streams.dev.brokers.common import free_port
from streams.dev.simulator import SimConfig, SimulatorServer
from streams.errors import ConfigError
from streams.pipelines.registry import PipelineRegistry
from streams.settings import Settings, load_settings
from streams.worker.preflight import llm_preflight

ROOT = Path(__file__).resolve().parents[3]


async def test_an_endpoint_that_answers_with_the_key_accepted_passes() -> None:
    server = SimulatorServer(SimConfig(api_key="k"))
    await server.start()
    try:
        seen = await llm_preflight(load_settings(llm={"base_url": server.base_url,
                                                        "api_key": "k", "model": "sim-1"}))  # fmt: skip
        assert "sim-1" in seen.models
        with pytest.raises(ConfigError, match=r"refused the key \(HTTP 401\).*OPENAI_API_KEY"):
            await llm_preflight(load_settings(llm={"base_url": server.base_url,
                                                   "api_key": "wrong"}))  # fmt: skip
    finally:
        await server.stop()


async def test_a_model_the_pipelines_name_and_the_endpoint_does_not_list_is_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A version's `model:` the endpoint does not list (a typo) is named at start with the
    versions asking for it; a listed one, the default's, and one a server listing a single
    model (llama.cpp answers any name) are not."""
    data = yaml.safe_load((ROOT / "pipelines" / "comment-analysis.yaml").read_text())
    v1 = data["versions"]["v1"]
    data["versions"] = {"v1": v1, "v2": {**v1, "model": "gpt-4o-mini"},
                        "v3": {**v1, "model": "gpt-4o-mnii"}}  # fmt: skip
    directory = tmp_path / "pipelines"
    directory.mkdir()
    (directory / "comment-analysis.yaml").write_text(yaml.safe_dump(data, allow_unicode=True))
    registry = PipelineRegistry.load(directory, ROOT / "schemas")
    for server, said in ((None, True), ("llama.cpp", False)):
        config = SimConfig(api_key="k") if server is None else SimConfig(api_key="k", server=server)
        up = await SimulatorServer(config).start()
        caplog.clear()
        try:
            settings = load_settings(llm={"base_url": up.base_url, "api_key": "k",
                                          "model": "sim-1"})  # fmt: skip
            await llm_preflight(settings, registry)
        finally:
            await up.stop()
        warned = [r.getMessage() for r in caplog.records if "lists no model" in r.getMessage()]
        if said:
            assert len(warned) == 1, warned
            assert "'gpt-4o-mnii', which comment-analysis v3 ask(s) for" in warned[0]
            assert "check their `model:`" in warned[0]
        else:
            assert warned == []


async def test_a_wrong_host_or_no_key_fails_at_once() -> None:
    with pytest.raises(ConfigError, match=r"does not resolve.*OPENAI_BASE_URL"):
        await asyncio.wait_for(llm_preflight(load_settings(llm={
            "base_url": "http://no-such-host.invalid:8000/v1", "api_key": "k"})), 30)  # fmt: skip
    with pytest.raises(ConfigError, match="no LLM key: set OPENAI_API_KEY"):
        await llm_preflight(load_settings())  # OpenAI's own endpoint, no key


async def test_an_endpoint_given_without_its_v1_is_said_at_once() -> None:
    """vLLM, LiteLLM and Ollama serve their OpenAI routes under /v1 alone: given without
    it, every call was a 404 — each model's circuit opened, every task waited out its
    deadline and ended `circuit_open` — while the start said nothing (no /models there
    read as a server without a model list)."""
    server = await SimulatorServer(SimConfig(api_key="k")).start()
    bare = server.base_url.removesuffix("/v1")
    try:
        with pytest.raises(ConfigError, match=rf"under /v1 — set OPENAI_BASE_URL .* to {bare}/v1"):
            await llm_preflight(load_settings(llm={"base_url": bare, "api_key": "k"}))
        assert "sim-1" in (await llm_preflight(load_settings(llm={
            "base_url": server.base_url, "api_key": "k"}))).models  # fmt: skip
    finally:
        await server.stop()


async def test_an_endpoint_away_at_start_is_waited_for_then_given_up_on() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    settings = load_settings(llm={"base_url": url, "api_key": "k", "startup_wait_s": 30})
    server = SimulatorServer(SimConfig(api_key="k"), port=port)
    checking = asyncio.create_task(llm_preflight(settings))
    await asyncio.sleep(1.5)  # refused meanwhile: it waits
    assert not checking.done()
    await server.start()  # the endpoint comes back
    try:
        assert "sim-1" in (await asyncio.wait_for(checking, 60)).models
    finally:
        await server.stop()
    gone = load_settings(llm={"base_url": url, "api_key": "k", "startup_wait_s": 1})
    with pytest.raises(ConfigError, match="still away after 1s"):
        await asyncio.wait_for(llm_preflight(gone), 60)


async def test_deployments_of_the_default_model_stand_in_for_the_endpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No OPENAI key needed when the deployments serve the default model; a deployment
    away is said and left to its breaker while another answers; a refused key names the
    deployment and the file."""
    up = await SimulatorServer(SimConfig(api_key="k-up")).start()
    (tmp_path / "up.key").write_text("k-up")
    path = tmp_path / "deployments.yaml"

    def declare(key_file: str) -> Settings:
        path.write_text(yaml.safe_dump({"deployments": [
            {"name": "up", "model": "sim-1", "base_url": up.base_url, "api_key_file": key_file},
            {"name": "away", "model": "sim-1", "base_url": f"http://127.0.0.1:{free_port()}/v1"},
        ]}))  # fmt: skip
        return load_settings(llm={"model": "sim-1", "deployments_file": path,
                                  "startup_wait_s": 1})  # fmt: skip

    try:
        seen = await llm_preflight(declare(str(tmp_path / "up.key")))
        assert (
            seen.endpoint.startswith("deployments up http://127.0.0.1") and "sim-1" in seen.models
        )
        assert "deployment away" in caplog.text and "its breaker" in caplog.text
        assert "lists no model" not in caplog.text
        path.write_text(yaml.safe_dump({"deployments": [
            {"name": "up", "model": "sim-1", "base_url": up.base_url,
             "api_key_file": str(tmp_path / "up.key")},
            {"name": "typo", "model": "sim-1", "base_url": up.base_url, "provider_model": "sim-l",
             "api_key_file": str(tmp_path / "up.key")},
        ]}))  # fmt: skip
        await llm_preflight(load_settings(llm={"model": "sim-1", "deployments_file": path}))
        assert "deployment typo" in caplog.text and "lists no model 'sim-l'" in caplog.text
        (tmp_path / "wrong.key").write_text("nope")
        with pytest.raises(ConfigError, match=r"deployment up .*refused the key.*DEPLOYMENTS_FILE"):
            await llm_preflight(declare(str(tmp_path / "wrong.key")))
    finally:
        await up.stop()


def test_the_banner_says_what_the_worker_is_and_where_to_look(tmp_path: Path) -> None:
    import shutil

    from streams.llm.endpoint import EndpointFacts
    from streams.pipelines.registry import PipelineRegistry
    from streams.worker.preflight import Preflight, banner

    root = Path(__file__).resolve().parents[3]
    settings = load_settings(llm={"base_url": "http://llm:8080/v1", "model": "local"},
                             web_port=6070)  # fmt: skip
    registry = PipelineRegistry.load(root / "pipelines", root / "schemas")
    seen = Preflight("http://llm:8080/v1/", ["local"],
                     EndpointFacts(server="llama.cpp", context_window=4096, slots=2))  # fmt: skip
    text = "\n".join(banner(settings, registry, seen))
    assert "LLM http://llm:8080/v1/ (llama.cpp), model local, window 4096 (said), 2 slots" in text
    assert "comment-analysis v1 (default v1)" in text
    assert "at_least_once" in text and "reads llm-tasks (live), llm-tasks-replay" in text
    assert "status http://" in text and ":6070/status" in text
    assert "sinks" not in text  # the shipped pipelines write only the project's topics
    with_sink = tmp_path / "pipelines"
    shutil.copytree(root / "pipelines", with_sink)
    path = with_sink / "comment-analysis.yaml"
    path.write_text(path.read_text() + "sink: {topic: shop.comments.analysed}\n")
    text = "\n".join(banner(settings, PipelineRegistry.load(with_sink, root / "schemas"), seen))
    assert (
        "; writes llm-results, llm-dead-letters, llm-review, sinks shop.comments.analysed" in text
    )
