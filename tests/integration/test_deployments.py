"""Deployments seen from a real worker on a real broker: one model served by three
deployments (OpenAI-style, Azure-style with its `api-key` header, and one failing for
30 s): every task ends once as a result, traffic moves off the failing one and comes
back once it is healthy, each deployment's spend at its own price."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from streams.dev.simulator import SimConfig, SimulatorServer
from tests.integration.helpers import WorkerProcess, collect, produce, ready_within

pytestmark = pytest.mark.integration


def _records(first: int, n: int) -> list[tuple[bytes | None, bytes | None]]:
    out: list[tuple[bytes | None, bytes | None]] = []
    for i in range(first, first + n):
        task = {"task_id": f"d-{i:04d}", "pipeline": "comment-analysis",
                "input": {"text": f"Order {i}: the lid cracked in the first week."}}  # fmt: skip
        out.append((task["task_id"].encode(), orjson.dumps(task)))
    return out


async def test_three_deployments_one_failing_for_thirty_seconds(
    make_settings: Any, tmp_path: Path
) -> None:
    east = await SimulatorServer(SimConfig(api_key="k-east", latency_ms=30, rpm=3000)).start()
    azure = await SimulatorServer(SimConfig(api_key="k-azure", latency_ms=30)).start()
    failing = await SimulatorServer(SimConfig(api_key="k-failing", latency_ms=30,
                                              error_500_rate=1.0)).start()  # fmt: skip
    keys = {}
    for name in ("east", "azure", "failing"):
        keys[name] = tmp_path / f"{name}.key"
        keys[name].write_text(f"k-{name}")
    path = tmp_path / "deployments.yaml"
    path.write_text(yaml.safe_dump({"deployments": [
        {"name": "east", "model": "sim-1", "base_url": east.base_url,
         "api_key_file": str(keys["east"]), "price_per_1k_prompt_usd": 1.0},
        {"name": "azure", "model": "sim-1", "auth": "azure",
         "base_url": azure.base_url.removesuffix("/v1"), "provider_model": "sim-1",
         "api_version": "2024-10-21", "api_key_file": str(keys["azure"]),
         "price_per_1k_prompt_usd": 2.0},
        {"name": "failing", "model": "sim-1", "base_url": failing.base_url,
         "api_key_file": str(keys["failing"]), "price_per_1k_prompt_usd": 4.0},
    ]}))  # fmt: skip
    settings = make_settings(
        llm={"model": "sim-1", "deployments_file": path, "max_attempts": 4,
             "backoff_base_s": 0.05, "backoff_max_s": 0.5, "task_deadline_s": 120},
        resilience={"breaker_window_s": 10, "breaker_min_calls": 5, "breaker_open_s": 3.0,
                    "breaker_probes": 2},
        batch={"size": 20, "concurrency": 16},
    )  # fmt: skip
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        await ready_within(worker, 90)
        await produce(settings, _records(0, 150))
        failing_since = time.monotonic()
        sent = 150
        await collect(settings, set(), timeout_s=120, worker=worker,
                      until=lambda g: len(g.results) + len(g.dead_letters) >= 150)  # fmt: skip
        # The router cools a failing deployment off between its calls (0.5 s, 1 s, ...), so
        # the breaker has its 5 verdicts only after a second or two of traffic; the healthy
        # two may have answered the first 150 by then. More tasks, a few at a time, until
        # the breaker judged (the 30 s of failure are not over before it).
        during = await worker.scrape()
        while during.value("llm_streams_breaker_state", endpoint="failing") != 2:
            assert time.monotonic() - failing_since < 20, (
                "the failing deployment's breaker never opened"
            )
            await produce(settings, _records(sent, 10))
            sent += 10
            await asyncio.sleep(0.5)
            during = await worker.scrape()
        code, ready = await worker.probe("/readyz")  # one deployment open: still ready
        await asyncio.sleep(max(0.0, 30 - (time.monotonic() - failing_since)))
        failing.sim.config.error_500_rate = 0.0  # healthy again
        served_while_failing = failing.sim.by_status[200]
        await asyncio.sleep(4)  # its circuit half-opens
        await produce(settings, _records(sent, 150))
        sent += 150
        got = await collect(settings, set(), timeout_s=120, worker=worker,
                            until=lambda g: len(g.results) + len(g.dead_letters) >= sent)  # fmt: skip
        after = await worker.scrape()
    finally:
        worker.stop()
        for server in (east, azure, failing):
            await server.stop()
    ended = Counter(r["task_id"] for r in got.results + got.dead_letters)
    assert set(ended) == {f"d-{i:04d}" for i in range(sent)} and set(ended.values()) == {1}
    assert got.dead_letters == []  # every task answered, by another deployment meanwhile
    assert code == 200 and ready["ready"] is True, ready
    assert served_while_failing == 0 and failing.sim.by_status[500] >= 5
    assert failing.sim.by_status[200] > 2  # back: more than its probes
    assert after.value("llm_streams_breaker_state", endpoint="failing") == 0
    assert azure.sim.by_status[200] > 0 and azure.sim.by_status[401] == 0  # api-key
    # Each deployment's tokens at its own price; the results' cost is their sum.
    prices = {"east": 1.0, "azure": 2.0, "failing": 4.0}
    servers = {"east": east, "azure": azure, "failing": failing}
    for name, price in prices.items():
        spent = after.value("llm_streams_deployment_cost_usd_total", deployment=name)
        tokens = servers[name].sim.prompt_tokens  # its answers' prompts: failed calls cost 0
        completion = servers[name].sim.completion_tokens * settings.llm.price_per_1k_completion_usd
        assert spent == pytest.approx((tokens * price + completion) / 1000), name
    for name in prices:  # each result's cost split by deployment, adding up to the metric
        split = sum(r["cost_by_deployment"].get(name, 0.0) for r in got.results)
        spent = after.value("llm_streams_deployment_cost_usd_total", deployment=name)
        assert split == pytest.approx(spent, rel=1e-6), name
    total = sum(r["cost_usd"] for r in got.results)
    assert total == pytest.approx(after.value("llm_streams_deployment_cost_usd_total"))
