"""An endpoint outage through the whole call path (processor -> guarded client -> SDK ->
simulator): the breaker opens, only probes reach the endpoint while it is down, and
after recovery every task ends as a result or a dead letter."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import orjson

from streams.contract.records import Source
from streams.dev.simulator import SimulatorServer
from streams.llm.openai_client import OpenAIClient
from streams.resilience.breaker import CircuitBreaker, State
from streams.resilience.retry import RetryPolicy
from tests.conftest import MakeProcessor

ROOT = Path(__file__).resolve().parents[3]


async def test_outage_opens_the_circuit_and_only_probes_reach_the_endpoint(
    simulator: SimulatorServer, make_processor: MakeProcessor
) -> None:
    transitions: list[tuple[float, State]] = []
    opened = asyncio.Event()

    def changed(_name: str, _old: State, new: State) -> None:
        transitions.append((time.monotonic(), new))
        if new is State.OPEN:
            opened.set()

    breaker = CircuitBreaker(
        "sim", window_s=10, min_calls=10, failure_rate=0.5, open_s=0.5, probes=2,
        on_change=changed,
    )  # fmt: skip
    client = OpenAIClient(
        base_url=simulator.base_url, api_key="k", connect_timeout_s=1, read_timeout_s=2
    )
    processor = make_processor(
        client, breaker=breaker, deadline_s=30,
        policy=RetryPolicy(max_attempts=20, backoff_base_s=0.05, backoff_max_s=0.2),
    )  # fmt: skip
    simulator.sim.config.latency_ms = 20
    simulator.sim.config.error_503_rate = 1.0  # the outage

    async def task(i: int) -> str:
        raw = orjson.dumps(
            {"task_id": f"o{i}", "pipeline": "comment-analysis", "input": {"text": f"fine {i}"}}
        )
        return (await processor.process(raw, None, Source(topic="t", partition=0, offset=i))).kind

    try:
        await _outage_then_recovery(simulator, breaker, transitions, task, opened)
    finally:
        await client.close()


async def _outage_then_recovery(simulator, breaker, transitions, task, opened):  # type: ignore[no-untyped-def]
    running = [asyncio.ensure_future(task(i)) for i in range(100)]
    await asyncio.wait_for(opened.wait(), timeout=30)
    await asyncio.sleep(0.2)  # calls let through before it opened land (20 ms latency)
    baseline = simulator.sim.snapshot()["requests"]
    before = sum(1 for _, s in transitions if s is State.HALF_OPEN)
    await asyncio.sleep(2.0)  # stay down for a while: only half-open probes may go
    during = simulator.sim.snapshot()["requests"] - baseline
    half_opens = sum(1 for _, s in transitions if s is State.HALF_OPEN) - before
    assert half_opens >= 2
    # Probes of each half-open period (one may have started just before the baseline).
    assert during <= (half_opens + 1) * breaker.probes, (during, half_opens)
    simulator.sim.config.error_503_rate = 0.0  # recovery
    kinds = await asyncio.gather(*running)
    assert kinds.count("result") + kinds.count("dead_letter") == 100
    assert kinds.count("result") == 100  # the deadline outlived the outage: all answered
    assert transitions[-1][1] is State.CLOSED
