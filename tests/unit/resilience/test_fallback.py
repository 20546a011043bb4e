"""Fallback models: when the primary endpoint fails or its circuit is open, the next model answers."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest

from streams.contract.records import Source
from streams.core.processor import TaskProcessor
from streams.dev.simulator import SimConfig, SimulatorServer
from streams.llm.openai_client import OpenAIClient
from streams.pipelines.registry import PipelineRegistry
from streams.resilience.breaker import CircuitBreaker, State
from streams.resilience.limiter import RateLimiter
from streams.resilience.pool import ClientPool
from streams.resilience.retry import RetryPolicy
from tests.conftest import MakeProcessor

ROOT = Path(__file__).resolve().parents[3]
SRC = Source(topic="t", partition=0, offset=1)


@pytest.fixture
async def backup() -> AsyncIterator[SimulatorServer]:
    server = await SimulatorServer(SimConfig(models=["backup-1"])).start()
    yield server
    await server.stop()


def _pipelines(tmp_path: Path, backup_url: str, fallback_on: str = "") -> tuple[Path, Path]:
    text = (ROOT / "pipelines" / "comment-analysis.yaml").read_text()
    extra = (
        "    fallbacks:\n"
        "      - model: sim-2\n"
        f"      - model: backup-1\n        base_url: {backup_url}\n        api_key_env: BACKUP_KEY\n"
        + (f"    fallback_on: [{fallback_on}]\n" if fallback_on else "")
    )
    text = text.replace(
        "    response_format: json_schema\n", "    response_format: json_schema\n" + extra
    )
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "c.yaml").write_text(text)
    shutil.copytree(ROOT / "schemas", tmp_path / "s")
    return tmp_path / "p", tmp_path / "s"


def _processor(
    sim: SimulatorServer, dirs: tuple[Path, Path], make_processor: MakeProcessor
) -> tuple[TaskProcessor, ClientPool]:
    pool = ClientPool(
        base_url=sim.base_url,
        api_key="k",
        make_http=lambda url, key: OpenAIClient(
            base_url=url, api_key=key, connect_timeout_s=1, read_timeout_s=1
        ),
        make_limiter=lambda: RateLimiter(rpm=1_000_000),
        make_breaker=lambda name: CircuitBreaker(name, min_calls=3, failure_rate=0.5, open_s=60),
    )
    processor = make_processor(
        guarded=pool.primary("sim-1"), registry=PipelineRegistry.load(*dirs),
        clients=pool.for_model, close=pool.close, deadline_s=10,
        policy=RetryPolicy(max_attempts=2, backoff_base_s=0.001, backoff_max_s=0.001),
    )  # fmt: skip
    return processor, pool


async def test_an_endpoint_outage_falls_back_to_another_endpoint(
    simulator: SimulatorServer,
    backup: SimulatorServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    make_processor: MakeProcessor,
) -> None:
    monkeypatch.setenv("BACKUP_KEY", "bk")
    backup.sim.config.api_key = "bk"  # the fallback's own key, read from its variable
    processor, pool = _processor(simulator, _pipelines(tmp_path, backup.base_url),
                                 make_processor)  # fmt: skip
    simulator.sim.config.error_503_rate = 1.0  # primary endpoint (sim-1 and sim-2) down
    try:
        raw = orjson.dumps(
            {"task_id": "f1", "pipeline": "comment-analysis", "input": {"text": "Great!"}}
        )
        result = orjson.loads((await processor.process(raw, None, SRC)).value)
        assert result["model"] == "backup-1"  # the result says which model answered
        # 2 calls to sim-1, 1 to sim-2, 1 to the backup: the endpoint's breaker opened
        # after 3 failures, so sim-2's second attempt was refused locally (no call).
        assert result["attempts"] == 4
        assert simulator.sim.snapshot()["by_status"] == {"503": 3}
        # Its circuit is now open: the next task goes straight to the backup.
        assert pool.primary("sim-1").breaker.state is State.OPEN
        raw = orjson.dumps(
            {"task_id": "f2", "pipeline": "comment-analysis", "input": {"text": "Bad."}}
        )
        result = orjson.loads((await processor.process(raw, None, SRC)).value)
        assert result["model"] == "backup-1" and result["attempts"] == 1
        assert simulator.sim.snapshot()["requests"] == 3
    finally:
        await processor.close()


async def test_categories_outside_fallback_on_do_not_fall_back(
    simulator: SimulatorServer,
    backup: SimulatorServer,
    tmp_path: Path,
    make_processor: MakeProcessor,
) -> None:
    processor, _ = _processor(
        simulator,
        _pipelines(tmp_path, backup.base_url, fallback_on="circuit_open"),
        make_processor,
    )
    simulator.sim.config.error_503_rate = 1.0
    try:
        raw = orjson.dumps(
            {"task_id": "f3", "pipeline": "comment-analysis", "input": {"text": "Great!"}}
        )
        letter = orjson.loads((await processor.process(raw, None, SRC)).value)
        assert letter["error"]["category"] == "upstream_error" and letter["attempts"] == 2
        assert backup.sim.snapshot()["requests"] == 0
    finally:
        await processor.close()
