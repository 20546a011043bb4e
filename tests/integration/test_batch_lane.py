"""A replay through the batch lane on real Kafka: 5,000 tasks, 2% of the batch's
requests failing, one batch expiring, the worker SIGKILLed while batches are in
flight. Every task ends as one result (at the batch price) or one dead letter,
and no request is sent again unless its earlier batch gave it no answer."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaProducer

from streams.dev.simulator import SimulatorServer
from streams.kafka.topics import ensure_topics
from tests.integration.helpers import (
    WorkerProcess,
    assert_one_outcome_each,
    collect,
    run_cli,
)

pytestmark = pytest.mark.integration

TASKS = 5000


async def _history(settings: Any, topic: str, tasks: list[dict[str, Any]]) -> None:
    await ensure_topics(settings)  # the worker's topics, co-partitioned, before any use
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap_servers, acks="all",
                                linger_ms=20)  # fmt: skip
    await producer.start()
    try:
        sent = [await producer.send(topic, key=t["task_id"].encode(), value=orjson.dumps(t))
                for t in tasks]  # fmt: skip
        await asyncio.gather(*sent)
    finally:
        await producer.stop()


async def test_a_replay_through_the_batch_lane_survives_failures_expiry_and_a_kill(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    cfg = simulator.sim.config
    cfg.batch_delay_s, cfg.batch_item_error_rate, cfg.batch_expire_next = 4.0, 0.02, 1
    settings = make_settings(
        llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1"},
        batch_api={
            "linger_s": 1.0,
            "max_items": 400,
            "poll_s": 0.5,
            "poll_max_s": 2.0,
            "intake_per_s": 500,
        },
    )
    history = f"history-{settings.app_id}"
    tasks = [{"task_id": f"old-{i:05d}", "pipeline": "comment-analysis",
              "input": {"text": f"Old comment {i}: the lid cracked after {i % 40} days."}}
             for i in range(TASKS)]  # fmt: skip
    await _history(settings, history, tasks)
    done = run_cli(settings, "replay", "--source", history, "--from-offset", "0:0",
                   "--lane", "batch", timeout_s=180)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "batch $" in done.stdout  # the cost per lane

    first = WorkerProcess(settings, tmp_path / "worker-1.log").start()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # batches created, some still running: kill
            assert first.alive(), first.log_tail()
            stats = simulator.sim.snapshot()
            if stats["batches"] >= 3 and stats["batches_by_status"].get("in_progress"):
                break
            await asyncio.sleep(0.2)
        else:
            raise AssertionError(f"no batches in flight:\n{first.log_tail()}")
        first.kill()
    finally:
        first.stop()
    at_kill = simulator.sim.snapshot()

    second = WorkerProcess(settings, tmp_path / "worker-2.log").start()
    try:
        ids = {t["task_id"] for t in tasks}
        got = await collect(settings, set(), timeout_s=300, worker=second, settle_s=2.0,
                            until=lambda g: ids <= {r["task_id"] for r in g.results + g.dead_letters})  # fmt: skip
        metrics = await second.scrape()
    finally:
        second.stop()

    assert_one_outcome_each(got, ids)
    assert not got.dead_letters, got.dead_letters[:3]
    stats = simulator.sim.snapshot()
    assert stats["requests"] == 0  # no synchronous call: everything went in batches
    assert stats["batches_by_status"].get("expired") == 1
    # Sent again only after the batch it was in gave it no answer (an expired batch, or
    # a failed request retried as the task's next attempt); never twice at once.
    batch_api = simulator.sim.batch
    again = 0
    for custom_id, outcomes in batch_api.outcomes.items():
        assert outcomes[-1] == "ok", (custom_id, outcomes)
        assert all(o in ("error", "expired") for o in outcomes[:-1]), (custom_id, outcomes)
        assert batch_api.submissions[custom_id] == len(outcomes), custom_id
        again += len(outcomes) - 1
    failed = sum(o.count("error") for o in batch_api.outcomes.values())
    assert failed > 0 and again >= failed  # the 2% were retried
    assert at_kill["batches"] < stats["batches"] or at_kill["batches_by_status"].get("in_progress")
    # Batch-priced: half the price table's cost for the tokens used.
    llm = settings.llm
    for r in got.results[:50]:
        full = (r["usage"]["prompt_tokens"] * llm.price_per_1k_prompt_usd
                + r["usage"]["completion_tokens"] * llm.price_per_1k_completion_usd) / 1000  # fmt: skip
        assert r["cost_usd"] == pytest.approx(full * settings.batch_api.price_ratio, rel=1e-3)
    assert metrics.value("llm_streams_batches_total", status="completed") > 0
    assert metrics.value("llm_streams_cost_usd_total", tier="batch") > 0


def _loaded(worker: WorkerProcess) -> bool:
    return "loaded in" in worker.log_path.read_text(errors="replace")


@pytest.mark.parametrize("guarantee", ["at_least_once", "exactly_once"])
async def test_batches_in_flight_survive_a_rebalance_and_a_kill_with_no_request_paid_twice(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path, guarantee: str
) -> None:
    """A second worker joins while the first has batches in flight (the rebalance must not
    wait for them), then the first is SIGKILLed: its partitions' new owner follows every
    batch to its end. The simulator's Batch API counts what it answered per request."""
    cfg = simulator.sim.config
    cfg.batch_delay_s, cfg.batch_item_error_rate, cfg.batch_expire_next = 60.0, 0.02, 1
    settings = make_settings(
        llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1"},
        batch_api={"linger_s": 1.0, "max_items": 100, "poll_s": 0.5, "poll_max_s": 2.0,
                   "intake_per_s": 500},
        processing_guarantee=guarantee,
    )  # fmt: skip
    history = f"history-{settings.app_id}"
    tasks = [{"task_id": f"old-{i:05d}", "pipeline": "comment-analysis",
              "input": {"text": f"Old comment {i}: the hinge squeaks after {i % 30} weeks."}}
             for i in range(1000)]  # fmt: skip
    await _history(settings, history, tasks)
    done = run_cli(settings, "replay", "--source", history, "--from-offset", "0:0",
                   "--lane", "batch", timeout_s=180)  # fmt: skip
    assert done.returncode == 0, done.stderr

    first = WorkerProcess(settings, tmp_path / "worker-1.log").start()
    second = WorkerProcess(settings.model_copy(update={"data_dir": tmp_path / "data-2"}),
                           tmp_path / "worker-2.log")  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while simulator.sim.snapshot()["batches_by_status"].get("in_progress", 0) < 3:
            assert first.alive(), first.log_tail()
            assert time.monotonic() < deadline, f"no batches in flight:\n{first.log_tail()}"
            await asyncio.sleep(0.2)
        joined_at = time.monotonic()
        second.start()  # a rebalance while 60 s batches run
        while not _loaded(second):
            assert second.alive(), second.log_tail()
            assert time.monotonic() < deadline + 120, second.log_tail()
            await asyncio.sleep(0.2)
        rebalance_s = time.monotonic() - joined_at
        in_flight = simulator.sim.snapshot()["batches_by_status"].get("in_progress", 0)
        first.kill()  # batches still in flight
        cfg.batch_delay_s = 3.0  # what is sent from now on (retries) ends sooner
        ids = {t["task_id"] for t in tasks}
        got = await collect(settings, set(), timeout_s=300, worker=second, settle_s=3.0,
                            read_committed=guarantee == "exactly_once",
                            until=lambda g: ids <= {r["task_id"] for r in g.results + g.dead_letters})  # fmt: skip
    finally:
        first.stop()
        second.stop()

    # The first worker's parked records did not hold the rebalance until their batches
    # ended (60 s): it took the group's usual time (a worker's start, the session timeout).
    assert rebalance_s < settings.kafka.session_timeout_s + 20, rebalance_s
    assert in_flight >= 3
    assert_one_outcome_each(got, ids)
    assert not got.dead_letters, got.dead_letters[:3]
    if guarantee == "exactly_once":  # one result record per task, read committed
        assert len(got.results) == len(ids), len(got.results)
    # Paid once: no request answered twice; sent again only after its batch gave it no
    # answer (the expired batch, or an error retried as the task's next attempt).
    batch_api = simulator.sim.batch
    twice = {c: o for c, o in batch_api.outcomes.items() if o.count("ok") > 1}
    assert not twice, list(twice.items())[:3]
    for custom_id, outcomes in batch_api.outcomes.items():
        assert outcomes[-1] == "ok", (custom_id, outcomes)
        assert all(o in ("error", "expired") for o in outcomes[:-1]), (custom_id, outcomes)
        assert batch_api.submissions[custom_id] == len(outcomes), custom_id
    assert simulator.sim.snapshot()["requests"] == 0
