"""Fixtures shared by unit and integration tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from streams.core.processor import ProcessorConfig, TaskProcessor
from streams.dev.simulator import SimConfig, SimulatorServer
from streams.llm.client import LLMClient
from streams.pipelines.registry import PipelineRegistry
from streams.resilience.breaker import CircuitBreaker
from streams.resilience.guarded import GuardedClient
from streams.resilience.limiter import RateLimiter
from streams.resilience.retry import RetryPolicy
from tests.fakes import FakeRegistry
from tests.prerequisites import missing

ROOT = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Stop before the first test when the machine lacks what the selected tests need."""
    needed = missing(
        kafka=any(item.get_closest_marker("integration") for item in items),
        chromium=any(item.get_closest_marker("browser") for item in items),
        helm=any(item.get_closest_marker("helm") for item in items),
    )
    if needed:
        raise pytest.UsageError(
            "the selected tests need, and this machine lacks:\n  - "
            + "\n  - ".join(needed)
            + "\nInstall them (README.md lists every requirement) and run the tests again."
        )


@pytest.fixture(autouse=True)
def own_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings loaded in a test keep their state (the on-disk task store) in the test's
    own directory, never in the checkout, and never shared with another test."""
    monkeypatch.setenv("LLM_STREAMS_DATA_DIR", str(tmp_path / "data"))


@pytest.fixture
async def simulator() -> AsyncIterator[SimulatorServer]:
    """An LLM simulator on a free loopback port; change `simulator.sim.config` per test."""
    server = SimulatorServer(SimConfig())
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture(scope="session")
def shipped_pipelines() -> PipelineRegistry:
    return PipelineRegistry.load(ROOT / "pipelines", ROOT / "schemas")


MakeProcessor = Callable[..., TaskProcessor]


@pytest.fixture
def make_processor(shipped_pipelines: PipelineRegistry) -> MakeProcessor:
    """A processor for `client` (a `tests.fakes.FakeLLM`, an OpenAIClient on the simulator):
    the shipped pipelines (or `registry`), no rate limit, a breaker that does not open,
    quick retries; `ProcessorConfig` fields as keywords override the defaults."""

    def make(
        client: LLMClient | None = None,
        *,
        guarded: GuardedClient | None = None,
        registry: PipelineRegistry | None = None,
        limiter: RateLimiter | None = None,
        breaker: CircuitBreaker | None = None,
        clients: Any = None,
        metrics: Any = None,
        close: Any = None,
        **config: Any,
    ) -> TaskProcessor:
        if guarded is None:
            assert client is not None, "give a client or a guarded client"
            guarded = GuardedClient(
                client,
                limiter=limiter or RateLimiter(rpm=1_000_000),
                breaker=breaker or CircuitBreaker("test", min_calls=1000),
            )
        defaults: dict[str, Any] = {
            "default_model": "sim-1",
            "policy": RetryPolicy(max_attempts=3, backoff_base_s=0.001, backoff_max_s=0.002),
            "deadline_s": 5,
            "max_task_bytes": 10_000,
        }
        return TaskProcessor(
            registry or shipped_pipelines, guarded, ProcessorConfig(**{**defaults, **config}),
            clients=clients, metrics=metrics, close=close,
        )  # fmt: skip

    return make


@pytest.fixture
async def fake_registry() -> AsyncIterator[FakeRegistry]:
    server = FakeRegistry()
    await server.start()
    try:
        yield server
    finally:
        server.hold.set()
        await server.runner.cleanup()
