"""The call layer's faults seen from a real worker on a real broker.

A slow provider makes the consumer pause fetching instead of buffering; a
60-second outage opens the breaker, which then lets only its probes through;
hung calls time out and are retried. After each, every task ends as exactly one
result or dead letter.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from streams.dev.simulator import SimulatorServer
from tests.integration.helpers import Scrape, WorkerProcess, collect, produce, ready_within

# Slow: waits out real timeouts, windows and sessions (tens of seconds each).
pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _records(n: int, prefix: str = "t") -> list[tuple[bytes | None, bytes | None]]:
    texts = ["Great value, works as described.", "Stopped working after two days.",
             "物流很快，东西不错。", "Meh. It is fine I guess."]  # fmt: skip
    out: list[tuple[bytes | None, bytes | None]] = []
    for i in range(n):
        task = {"task_id": f"{prefix}-{i:05d}", "pipeline": "comment-analysis",
                "input": {"text": f"{texts[i % len(texts)]} ({i})"}}  # fmt: skip
        out.append((task["task_id"].encode(), orjson.dumps(task)))
    return out


async def _wait_for(worker: WorkerProcess, check: Any, *, timeout_s: float, what: str) -> Scrape:
    """Scrape /metrics until `check(scrape)` holds."""
    deadline = time.monotonic() + timeout_s
    last: Scrape | None = None
    while time.monotonic() < deadline:
        assert worker.alive(), worker.log_tail()
        try:
            last = await worker.scrape()
        except OSError:  # web server not up yet
            await asyncio.sleep(0.5)
            continue
        if check(last):
            return last
        await asyncio.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}:\n{last.text if last else ''}")


def _each_task_ends_once(records: list[tuple[bytes | None, bytes | None]], got: Any) -> None:
    ended = Counter(r["task_id"] for r in got.results) + Counter(
        d["task_id"] for d in got.dead_letters
    )
    expected = {k.decode() for k, _ in records if k}
    assert set(ended) == expected, f"missing: {sorted(expected - set(ended))[:5]}"
    assert all(n == 1 for n in ended.values()), [t for t, n in ended.items() if n > 1]


async def test_slow_provider_pauses_fetching_instead_of_buffering(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    cfg = simulator.sim.config
    cfg.latency_ms, cfg.latency_dist = 15_000, "fixed"  # a saturated provider
    concurrency, batch, buffer, n = 8, 20, 100, 3000
    settings = make_settings(
        llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1",
             "read_timeout_s": 60},
        batch={"size": batch, "concurrency": concurrency, "buffer": buffer},
    )  # fmt: skip
    records = _records(n)
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        await produce(settings, records)
        stalled = await _wait_for(
            worker,
            lambda m: (
                m.value("llm_streams_tasks_in_flight") == concurrency
                and m.value("llm_streams_backpressure_paused_partitions") >= 1
            ),
            timeout_s=60,
            what="the worker to fill its slots and pause fetching",
        )
        await asyncio.sleep(3)  # time in which an unbounded consumer would keep fetching
        held = await worker.scrape()
        for m in (stalled, held):
            # Taken off the stream: the running tasks plus at most one micro-batch.
            assert m.value("llm_streams_tasks_received_total") <= concurrency + batch
            assert m.value("llm_streams_tasks_in_flight") == concurrency
            # Fetched ahead: one buffer plus at most one poll's worth.
            assert m.value("llm_streams_stream_buffered_records") <= 2 * buffer
            # Nothing finished, so nothing committed: the lag is the whole topic.
            assert m.value("llm_streams_consumer_lag") == n
        assert held.value("llm_streams_backpressure_paused_partitions") >= 1
        assert simulator.sim.snapshot()["max_in_flight"] <= concurrency

        cfg.latency_ms = 0  # the provider catches up
        got = await collect(
            settings, set(), timeout_s=240, worker=worker, until=lambda g: len(g.results) >= n
        )
        drained = await _wait_for(
            worker, lambda m: m.value("llm_streams_consumer_lag") == 0, timeout_s=30,
            what="the lag to drain")  # fmt: skip
    finally:
        worker.stop()
    _each_task_ends_once(records, got)
    assert len(got.results) == n
    assert drained.value("llm_streams_tasks_unfinished") == 0
    assert drained.value("llm_streams_backpressure_paused_partitions") == 0


async def test_sixty_second_outage_opens_the_breaker_and_only_probes_reach_the_provider(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    min_calls, open_s, probes, concurrency = 10, 5.0, 2, 16
    settings = make_settings(
        llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1",
             "max_attempts": 4, "backoff_base_s": 0.05, "backoff_max_s": 0.5,
             "task_deadline_s": 240},
        resilience={"breaker_window_s": 10, "breaker_min_calls": min_calls,
                    "breaker_failure_rate": 0.5, "breaker_open_s": open_s,
                    "breaker_probes": probes},
        batch={"size": 50, "concurrency": concurrency},
    )  # fmt: skip
    records = _records(400)
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        await _wait_for(worker, lambda m: True, timeout_s=60, what="the worker's web port")
        before = await ready_within(worker, 60)  # joined, every store loaded
        simulator.sim.config.error_503_rate = 1.0  # the provider is down
        await produce(settings, records)
        await _wait_for(
            worker, lambda m: m.value("llm_streams_breaker_state") == 2, timeout_s=30,
            what="the breaker to open")  # fmt: skip
        opened_at = time.monotonic()
        code, down = await worker.probe("/readyz")  # not ready: its calls are refused
        alive_code, alive = await worker.probe("/healthz")  # but alive: no restart for it
        before_open = simulator.sim.snapshot()["requests"]
        await asyncio.sleep(60)
        during = simulator.sim.snapshot()["requests"] - before_open
        simulator.sim.config.error_503_rate = 0.0  # back up
        got = await collect(settings, set(), timeout_s=240, worker=worker,
                            until=lambda g: len(g.results) + len(g.dead_letters) >= len(records))  # fmt: skip
        metrics = await worker.scrape()
        after = await ready_within(worker, 30)
    finally:
        worker.stop()
    assert sorted(before["partitions"]) == [0, 1, 2, 3] and before["loading"] == []
    assert code == 503 and down["ready"] is False and down["open_breakers"], down
    assert any("breaker open" in reason for reason in down["reasons"]), down
    assert (alive_code, alive["alive"]) == (200, True)
    assert after["ready"] is True and after["reasons"] == []
    # While open, only half-open probes went out: `probes` per open period, plus calls
    # that were already in flight when it opened.
    periods = int((time.monotonic() - opened_at) / open_s) + 1
    assert during <= probes * periods + concurrency, (during, periods)
    assert before_open <= min_calls + concurrency * 4  # it opened within a few rounds
    _each_task_ends_once(records, got)
    # Tasks whose attempts ran out before it opened are dead letters; all others answered.
    for d in got.dead_letters:
        assert d["error"]["category"] == "upstream_error", d["error"]
    assert len(got.results) >= len(records) - before_open
    assert metrics.value("llm_streams_breaker_transitions_total", to="open") >= 1
    assert metrics.value("llm_streams_breaker_transitions_total", to="closed") >= 1
    assert metrics.value("llm_streams_breaker_state") == 0


async def test_hung_calls_time_out_and_are_retried(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    cfg = simulator.sim.config
    cfg.hang_rate, cfg.hang_s = 0.05, 600
    settings = make_settings(
        llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1",
             "read_timeout_s": 2, "max_attempts": 4, "backoff_base_s": 0.05,
             "backoff_max_s": 0.5},
        batch={"size": 50, "concurrency": 32},
    )  # fmt: skip
    records = _records(300)
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        await produce(settings, records)
        got = await collect(settings, set(), timeout_s=240, worker=worker,
                            until=lambda g: len(g.results) + len(g.dead_letters) >= len(records))  # fmt: skip
        metrics = await worker.scrape()
    finally:
        worker.stop()
    _each_task_ends_once(records, got)
    hangs = simulator.sim.snapshot()["by_outcome"]["hang"]
    assert hangs > 0
    assert metrics.value("llm_streams_llm_requests_total", category="timeout") == hangs
    # 4 hangs in a row (p = 0.05^4) is the only way to a dead letter.
    assert len(got.dead_letters) == 0, [d["error"] for d in got.dead_letters]
    assert any(r["attempts"] > 1 for r in got.results)


def _with_fallback(tmp_path: Path) -> Path:
    """The shipped pipelines, comment-analysis with a fallback model on the same endpoint."""
    folder = tmp_path / "pipelines"
    folder.mkdir()
    for path in (ROOT / "pipelines").glob("*.yaml"):
        spec = yaml.safe_load(path.read_text())
        if spec["name"] == "comment-analysis":
            for version in spec["versions"].values():
                version["fallbacks"] = [{"model": "gpt-4o-mini"}]
        (folder / path.name).write_text(yaml.safe_dump(spec))
    return folder


async def test_after_an_outage_whose_probes_hang_past_the_deadline_results_flow_again(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    """503s, then every call hanging past the task deadline (probes included), then
    recovery: the breaker closes and the tasks sent after recovery are answered, with no
    restart. A fallback model is configured, so each guarded call must take one slot."""
    cfg = simulator.sim.config
    settings = make_settings(
        llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1",
             "task_deadline_s": 4, "read_timeout_s": 30, "max_attempts": 4,
             "backoff_base_s": 0.05, "backoff_max_s": 0.3},
        resilience={"breaker_window_s": 10, "breaker_min_calls": 5, "breaker_open_s": 2,
                    "breaker_probes": 2, "breaker_slow_call_s": 1.5},
        batch={"size": 20, "concurrency": 16},
        pipelines_dir=_with_fallback(tmp_path),
    )  # fmt: skip
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        await _wait_for(worker, lambda m: True, timeout_s=60, what="the worker's web port")
        cfg.error_503_rate = 1.0  # down
        await produce(settings, _records(40, "down"))
        await _wait_for(worker, lambda m: m.value("llm_streams_breaker_state") == 2,
                        timeout_s=30, what="the breaker to open")  # fmt: skip
        cfg.error_503_rate, cfg.hang_rate, cfg.hang_s = 0.0, 1.0, 60.0  # every call hangs
        await produce(settings, _records(40, "hung"))
        await asyncio.sleep(10)  # probes hang past their tasks' 4-s deadline, several rounds
        cfg.hang_rate = 0.0  # recovered
        recovered_at = simulator.sim.snapshot()["requests"]
        await asyncio.sleep(3)
        after = _records(50, "after")
        await produce(settings, after)
        got = await collect(settings, set(), timeout_s=60, worker=worker,
                            until=lambda g: {r["task_id"] for r in g.results}
                            >= {k.decode() for k, _ in after if k})  # fmt: skip
        metrics = await worker.scrape()
    finally:
        worker.stop()
    answered = {r["task_id"] for r in got.results}
    assert answered >= {k.decode() for k, _ in after if k}, worker.log_tail()
    assert simulator.sim.snapshot()["requests"] >= recovered_at + 50
    assert metrics.value("llm_streams_breaker_state") == 0
    assert metrics.value("llm_streams_breaker_transitions_total", to="closed") >= 1
