"""Deployments: three simulator processes serve one model, at 1,000 / 2,000 / 3,000 RPM
(sub-minute enforcement, 1 s bursts), each with another header style — OpenAI's
(`remaining` against the minute), a gateway's (`remaining` against the enforcing
second), and Azure OpenAI's path and `api-key` header. The worker is told none of the
limits: each deployment's limiter learns its own.

Phases (Apache Kafka 4.1.1 from jars; latency 300 +- 100 ms):

1. one worker, a backlog: answers/min over the busy span against the 6,000 RPM sum,
   and the share of calls answered 429;
2. the same with two workers in one group (each claims its share of every limit);
3. failover: one worker at a paced 40 tasks/s (2,400 RPM, under the sum of the other
   two), the 3,000 RPM deployment answering only 500s from 20 s in: seconds until the
   results per second are back at the offered rate (5 s in a row at >= 95%), the 500s
   it answered, and the dead letters (none expected).

    python bench/deployments.py [--tasks 6000] [--phases 1,2,3]
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
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import yaml
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from latency import paced
from pipeline_overhead import group_stable, preload, stop, warm_up
from rate_limit_utilisation import Sim, figures

from streams.dev.brokers.apache import ApacheKafka
from streams.dev.brokers.common import free_port
from streams.kafka.topics import ensure_topics
from streams.settings import Settings, load_settings, settings_env

LIMITS = {"openai-style": 1000, "per-second": 2000, "azure-style": 3000}


def start_sims() -> dict[str, Sim]:
    sims = {name: Sim(rpm, rpm * 800) for name, rpm in LIMITS.items()}
    sims["per-second"].call("/sim/config", {"remaining_window_s": 1.0})
    return sims


def deployments_file(sims: dict[str, Sim], path: Path) -> Path:
    entries: list[dict[str, Any]] = []
    for name, sim in sims.items():
        entry: dict[str, Any] = {"name": name, "model": "sim-1", "api_key_env": "BENCH_KEY",
                                 "base_url": f"{sim.base}/v1"}  # fmt: skip
        if name == "azure-style":
            entry.update(auth="azure", base_url=sim.base, provider_model="sim-1",
                         api_version="2024-10-21")  # fmt: skip
        entries.append(entry)
    path.write_text(yaml.safe_dump({"deployments": entries}))
    return path


def bench_settings(kafka: ApacheKafka, sims: dict[str, Sim], logdir: Path) -> Settings:
    suffix = uuid.uuid4().hex[:6]
    return load_settings(
        app_id=f"dep-{suffix}",
        kafka={"broker_url": kafka.url, "partitions": 4},
        topics={n: f"{n}-{suffix}" for n in ("tasks", "replay", "results", "dead_letters", "review")},
        llm={"model": "sim-1", "max_attempts": 6, "task_deadline_s": 300,
             "deployments_file": deployments_file(sims, logdir / f"deployments-{suffix}.yaml")},
        batch={"size": 200, "window_s": 0.05, "concurrency": 64},
        data_dir=logdir / f"w-{suffix}",
        log_level="warning",
    )  # fmt: skip


def spawn(settings: Settings, logdir: Path, i: int) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_STREAMS_")}
    env.update(settings_env(settings))
    env.update(BENCH_KEY=Sim.KEY, LLM_STREAMS_WEB_PORT=str(free_port()),
               LLM_STREAMS_DATA_DIR=str(logdir / f"{settings.app_id}-{i}"))  # fmt: skip
    with open(logdir / f"worker-{settings.app_id}-{i}.log", "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "streams.cli", "worker"], env=env,
                                stdout=log, stderr=subprocess.STDOUT)  # fmt: skip


async def outcomes(settings: Settings, bootstrap: str, n: int, timeout_s: float,
                   arrived: list[float], dead: Counter[str]) -> None:  # fmt: skip
    """Read `n` outcomes, each one's arrival time into `arrived`, dead letters by code."""
    consumer = AIOKafkaConsumer(
        settings.topics.results, settings.topics.dead_letters, bootstrap_servers=bootstrap,
        group_id=f"r-{settings.app_id}", auto_offset_reset="earliest", enable_auto_commit=False,
    )  # fmt: skip
    await consumer.start()
    try:
        deadline = time.monotonic() + timeout_s
        while len(arrived) < n and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=200)
            now = time.monotonic()
            for tp, records in batch.items():
                for rec in records:
                    arrived.append(now)
                    if tp.topic == settings.topics.dead_letters:
                        dead[orjson.loads(rec.value)["error"]["code"]] += 1
    finally:
        await consumer.stop()
    if len(arrived) < n:
        raise RuntimeError(f"only {len(arrived)}/{n} outcomes")


async def backlog(kafka: ApacheKafka, sims: dict[str, Sim], n: int, workers: int,
                  logdir: Path) -> tuple[list[tuple[str, float, float, float]], Counter[str]]:  # fmt: skip
    """Phases 1 and 2: per deployment and in all, answers/min over the busy span against
    its limit, the steady state, the 429 share."""
    for name, sim in sims.items():
        sim.reset(LIMITS[name])
    settings = bench_settings(kafka, sims, logdir)
    await ensure_topics(settings)
    procs = [spawn(settings, logdir, i) for i in range(workers)]
    arrived: list[float] = []
    dead: Counter[str] = Counter()
    try:
        await group_stable(settings, workers, timeout_s=180)
        await preload(kafka.bootstrap, settings.topics.tasks, n)
        await outcomes(settings, kafka.bootstrap, n, 900, arrived, dead)
    finally:
        for p in procs:
            stop(p)
    span = max(arrived) - min(arrived)
    rows, ok, calls, refused = [], 0, 0, 0
    for name, sim in sims.items():
        stats = sim.call("/sim/stats")
        rows.append((name, *figures(stats, LIMITS[name], span)))
        ok += stats["by_status"].get("200", 0)
        calls += stats["requests"]
        refused += stats["by_status"].get("429", 0)
    total = sum(LIMITS.values())
    rows.append(("all three", ok / span * 60 / total, float("nan"), refused / max(calls, 1)))
    return rows, dead


async def failover(kafka: ApacheKafka, sims: dict[str, Sim], rate: float, seconds: float,
                   fail_at_s: float, logdir: Path) -> dict[str, Any]:  # fmt: skip
    """Phase 3: the azure-style deployment answers only 500s from `fail_at_s` on."""
    for name, sim in sims.items():
        sim.reset(LIMITS[name])
    settings = bench_settings(kafka, sims, logdir)
    await ensure_topics(settings)
    proc = spawn(settings, logdir, 0)
    n = int(rate * seconds)
    arrived: list[float] = []
    dead: Counter[str] = Counter()
    producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap, linger_ms=5)
    await producer.start()
    try:
        await group_stable(settings, 1, timeout_s=180)
        reading = asyncio.create_task(outcomes(settings, kafka.bootstrap, n, 600, arrived, dead))
        start = time.monotonic()
        sending = asyncio.create_task(paced(producer, settings.topics.tasks, rate, n, "f", {}))
        await asyncio.sleep(fail_at_s)
        sims["azure-style"].call("/sim/config", {"error_500_rate": 1.0})
        failed_at = time.monotonic()
        await sending
        await reading
    finally:
        await producer.stop()
        stop(proc)
    per_s = Counter(int(t - start) for t in arrived)
    first = int(failed_at - start) + 1
    back = next((s for s in range(first, int(seconds) - 4)
                 if all(per_s[s + i] >= 0.95 * rate for i in range(5))), None)  # fmt: skip
    return {"back_after_s": None if back is None else back - (failed_at - start),
            "500s": sims["azure-style"].call("/sim/stats")["by_status"].get("500", 0),
            "dead": dead, "before": sum(per_s[s] for s in range(2, first - 1)) / max(1, first - 3),
            "timeline": " ".join(f"{s - first + 1:+d}:{per_s[s]}" for s in range(first - 3, first + 12))}  # fmt: skip


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=6000)
    parser.add_argument("--phases", default="1,2,3")
    args = parser.parse_args()
    phases = {int(p) for p in args.phases.split(",")}
    logdir = Path(tempfile.mkdtemp(prefix="llm-streams-deployments-"))
    sims = start_sims()
    report: list[str] = []
    try:
        with ApacheKafka(heap_mb=1024) as kafka:
            await warm_up(kafka, 5000)
            for workers in (w for w in (1, 2) if w in phases):
                rows, dead = await backlog(kafka, sims, args.tasks, workers, logdir)
                report.append(f"\n{workers} worker(s), {args.tasks} tasks, limits learned "
                              f"(dead letters: {dict(dead) or 'none'})")  # fmt: skip
                report.append(f"  {'deployment':<14} {'RPM limit':>9} {'answers/min / limit':>20}"
                              f" {'steady-state':>13} {'429 share':>10}")  # fmt: skip
                for name, util, steady, share in rows:
                    limit = LIMITS.get(name, sum(LIMITS.values()))
                    report.append(f"  {name:<14} {limit:>9} {util:>20.3f} {steady:>13.3f}"
                                  f" {share:>10.4f}")  # fmt: skip
            if 3 in phases:
                got = await failover(kafka, sims, 40.0, 60.0, 20.0, logdir)
                back = got["back_after_s"]
                report.append(
                    f"\nfailover at 40 tasks/s: azure-style (3,000 RPM) answers only 500s from "
                    f"20 s; results/s before {got['before']:.1f}; back at >= 95% of the offered "
                    f"rate {'never' if back is None else f'{back:.1f} s'} after the failure; "
                    f"{got['500s']} 500s answered; dead letters {dict(got['dead']) or 'none'}"
                )
                report.append(f"  results per second around it: {got['timeline']}")
    finally:
        for sim in sims.values():
            stop(sim.proc)
    print("deployments: 1,000 / 2,000 / 3,000 RPM (openai-style headers, remaining per "
          "second, azure-style path and api-key), latency 300+-100 ms, 1% 500s")  # fmt: skip
    print("\n".join(report))
    print(f"logs: {logdir}")


if __name__ == "__main__":
    asyncio.run(main())
