"""Horizontal scaling: throughput with 1, 2 and 3 workers in one consumer group.

One run, one broker (Apache Kafka 4.1.1 from jars), one LLM simulator process
answering in 300 ms (fixed) under a high RPM limit, a per-worker concurrency cap
(`--concurrency`, default 16: one worker can do at most 16 / 0.3 s = 53 tasks/s).
For each n: fresh 12-partition topics, n workers started and their group stable
(n members, every partition assigned), then n x `--tasks-per-worker` tasks
produced at once; throughput = tasks / (last outcome - first record produced).
Prints each n's throughput and the scaling efficiency
throughput(n) / (n x throughput(1)).

    python bench/scaling.py [--tasks-per-worker 1500] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_overhead import group_stable, preload, stop, warm_up
from rate_limit_utilisation import Sim

from streams.dev.brokers.apache import ApacheKafka
from streams.dev.brokers.common import free_port
from streams.kafka.topics import ensure_topics
from streams.settings import load_settings, settings_env

PARTITIONS = 12
LATENCY_MS = 300


async def run(kafka: ApacheKafka, sim: Sim, workers: int, tasks: int, concurrency: int,
              logdir: Path) -> tuple[float, int]:  # fmt: skip
    """Throughput (tasks/s) of `tasks` through `workers` workers, and dead letters."""
    suffix = uuid.uuid4().hex[:6]
    settings = load_settings(
        app_id=f"scale-{suffix}",
        kafka={"broker_url": kafka.url, "partitions": PARTITIONS, "session_timeout_s": 6},
        topics={n: f"{n}-{suffix}" for n in ("tasks", "replay", "results", "dead_letters", "review")},
        llm={"base_url": f"{sim.base}/v1", "api_key": sim.KEY, "model": "sim-1",
             "max_attempts": 6, "task_deadline_s": 300},
        batch={"size": 100, "window_s": 0.05, "concurrency": concurrency},
        log_level="warning",
    )  # fmt: skip
    await ensure_topics(settings)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_STREAMS_")}
    env.update(settings_env(settings))
    procs = []
    for i in range(workers):
        env_i = {**env, "LLM_STREAMS_WEB_PORT": str(free_port()),
                 "LLM_STREAMS_DATA_DIR": str(logdir / f"data-{suffix}-{i}")}  # fmt: skip
        with open(logdir / f"worker-{suffix}-{i}.log", "wb") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "streams.cli", "worker"],
                                          env=env_i, stdout=log, stderr=subprocess.STDOUT))  # fmt: skip
    consumer = AIOKafkaConsumer(
        settings.topics.results, settings.topics.dead_letters,
        bootstrap_servers=kafka.bootstrap, group_id=f"s-{suffix}",
        auto_offset_reset="earliest", enable_auto_commit=False,
    )  # fmt: skip
    await consumer.start()
    dead = 0
    try:
        await group_stable(settings, workers)
        started = time.monotonic()
        await preload(kafka.bootstrap, settings.topics.tasks, tasks)
        seen, last = 0, 0.0
        deadline = time.monotonic() + 900
        while seen < tasks and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=200)
            for tp, records in batch.items():
                seen += len(records)
                if tp.topic == settings.topics.dead_letters:
                    dead += len(records)
                if records:
                    last = time.monotonic()
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a worker exited; logs in {logdir}")
    finally:
        await consumer.stop()
        for p in procs:
            stop(p)
    if seen < tasks:
        raise RuntimeError(f"only {seen}/{tasks} outcomes; logs in {logdir}")
    return tasks / (last - started), dead


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks-per-worker", type=int, default=1500)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--workers", default="1,2,3")
    args = parser.parse_args()
    counts = [int(n) for n in args.workers.split(",")]
    logdir = Path(tempfile.mkdtemp(prefix="llm-streams-scale-"))
    rpm = 1_000_000  # high: the concurrency cap, not the provider, bounds each worker
    sim = Sim(rpm, rpm * 1000, jitter_ms=0, error_rate=0.0, latency_ms=LATENCY_MS)
    rows: list[tuple[int, float, int]] = []
    try:
        with ApacheKafka(heap_mb=1024) as kafka:
            await warm_up(kafka, 5000)
            for n in counts:
                sim.reset(rpm)
                throughput, dead = await run(kafka, sim, n, n * args.tasks_per_worker,
                                             args.concurrency, logdir)  # fmt: skip
                rows.append((n, throughput, dead))
                stats: dict[str, Any] = sim.call("/sim/stats")
                if stats["by_status"].get("429"):
                    print(f"warning: {stats['by_status']['429']} answers were 429s")
    finally:
        stop(sim.proc)
    ceiling = args.concurrency / (LATENCY_MS / 1000)
    print(
        f"simulator: {LATENCY_MS} ms fixed latency, RPM limit {rpm:,}; per-worker concurrency "
        f"{args.concurrency} (ceiling {ceiling:.1f} tasks/s per worker); {PARTITIONS} partitions; "
        f"{args.tasks_per_worker} tasks per worker"
    )
    base = next((t for n, t, _ in rows if n == 1), None)
    print(
        f"{'workers':>7} {'tasks/s':>9} {'of ceiling':>11} {'efficiency':>11} {'dead letters':>13}"
    )
    for n, throughput, dead in rows:
        eff = f"{throughput / (n * base):.2f}" if base else "-"
        print(f"{n:>7} {throughput:>9.1f} {throughput / (n * ceiling):>11.2f} {eff:>11} {dead:>13}")
    print(f"logs: {logdir}")
    print(orjson.dumps({str(n): round(t, 2) for n, t, _ in rows}).decode())


if __name__ == "__main__":
    asyncio.run(main())
