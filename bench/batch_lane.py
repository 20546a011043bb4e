"""The batch lane: cost per accepted task through sync calls vs the Batch API, and the
live lane's latency while a batch-lane replay runs.

One run, one broker (Apache Kafka 4.1.1 from jars), one LLM simulator process
(latency 300 +- 100 ms, RPM limit R, batches finish `--batch-delay` seconds
after creation), one llm-streams worker. Phases:

1. live traffic alone (`--live-rate`/s for `--seconds`): p95 end to end;
2. a replay of N tasks in the sync tier (`llm-streams-tier: sync`);
3. a replay of N other tasks in the batch tier, with the same live traffic as
   phase 1 running meanwhile.

Printed: cost per accepted task (results' cost_usd, from the price table at
batch_api.price_ratio for batch) for phases 2 and 3 and their ratio (target
<= 0.55), and the live p95 of phase 3 over phase 1.

    python bench/batch_lane.py [--tasks 2000] [--live-rate 10] [--seconds 30]
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

import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_overhead import stop, warm_up
from rate_limit_utilisation import Sim
from replay_isolation import Run, percentile

from streams.contract.headers import TIER_HEADER
from streams.dev.brokers.apache import ApacheKafka
from streams.dev.brokers.common import free_port
from streams.kafka.topics import ensure_topics
from streams.settings import Settings, load_settings, settings_env


class Costs:
    """Replay-lane results by tier: accepted tasks and what they cost."""

    def __init__(self) -> None:
        self.cost: dict[str, float] = {"sync": 0.0, "batch": 0.0}
        self.accepted: dict[str, int] = {"sync": 0, "batch": 0}
        self.dead: dict[str, int] = {"sync": 0, "batch": 0}

    async def read(self, settings: Settings, stop_event: asyncio.Event) -> None:
        consumer = AIOKafkaConsumer(
            settings.topics.results, settings.topics.dead_letters,
            bootstrap_servers=settings.bootstrap_servers, group_id=f"cost-{uuid.uuid4().hex[:6]}",
            auto_offset_reset="earliest", enable_auto_commit=False,
        )  # fmt: skip
        await consumer.start()
        try:
            while not stop_event.is_set():
                for tp, records in (await consumer.getmany(timeout_ms=200)).items():
                    for rec in records:
                        value = orjson.loads(rec.value)
                        task_id = str(value.get("task_id") or "")
                        tier = "batch" if task_id.startswith("b-") else "sync"
                        if not task_id.startswith(("b-", "s-")):
                            continue
                        if tp.topic == settings.topics.dead_letters:
                            self.dead[tier] += 1
                        else:
                            self.accepted[tier] += 1
                            self.cost[tier] += value["cost_usd"]
        finally:
            await consumer.stop()

    def per_task(self, tier: str) -> float:
        return self.cost[tier] / max(1, self.accepted[tier])


async def publish(producer: AIOKafkaProducer, settings: Settings, n: int, tier: str) -> None:
    futures = []
    for i in range(n):
        task_id = f"{tier[0]}-{i:06d}"
        task = {"task_id": task_id, "pipeline": "comment-analysis",
                "input": {"text": f"Order {tier}-{i}: arrived late, the lid cracked, works otherwise."}}  # fmt: skip
        futures.append(await producer.send(
            settings.topics.replay, key=task_id.encode(), value=orjson.dumps(task),
            headers=[(TIER_HEADER, tier.encode())],
        ))  # fmt: skip
    await asyncio.gather(*futures)


async def until(check: object, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not check():  # type: ignore[operator]
        await asyncio.sleep(0.5)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--rpm", type=int, default=3000)
    parser.add_argument("--live-rate", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--batch-delay", type=float, default=20.0)
    args = parser.parse_args()
    logdir = Path(tempfile.mkdtemp(prefix="llm-streams-batch-"))
    sim = Sim(args.rpm, args.rpm * 2000)
    sim.call("/sim/config", {"batch_delay_s": args.batch_delay})
    suffix = uuid.uuid4().hex[:6]
    n = args.tasks
    try:
        with ApacheKafka(heap_mb=1024) as kafka:
            await warm_up(kafka, 5000)
            settings = load_settings(
                app_id=f"batch-{suffix}",
                kafka={"broker_url": kafka.url, "partitions": 4},
                topics={t: f"{t}-{suffix}" for t in ("tasks", "replay", "results", "dead_letters", "review")},
                llm={"base_url": f"{sim.base}/v1", "api_key": sim.KEY, "model": "sim-1",
                     "max_attempts": 6, "task_deadline_s": 600},
                batch={"size": 200, "window_s": 0.05, "concurrency": 64},
                batch_api={"linger_s": 2.0, "poll_s": 1.0, "poll_max_s": 5.0},
                data_dir=logdir / "worker", log_level="warning",
            )  # fmt: skip
            await ensure_topics(settings)
            env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_STREAMS_")}
            env.update(settings_env(settings))
            env["LLM_STREAMS_WEB_PORT"] = str(free_port())
            with open(logdir / "worker.log", "wb") as log:
                worker = subprocess.Popen([sys.executable, "-m", "streams.cli", "worker"],
                                          env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
            run, costs = Run(settings, logdir), Costs()
            stop_reading = asyncio.Event()
            readers = [asyncio.create_task(run.read(stop_reading)),
                       asyncio.create_task(costs.read(settings, stop_reading))]  # fmt: skip
            producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap, linger_ms=5, acks=1)
            await producer.start()
            try:
                await run.wait_for(await run.live(producer, 5, 3, "warm"), 120)
                alone = await run.live(producer, args.live_rate, args.seconds, "alone")
                await run.wait_for(alone, 120)
                await publish(producer, settings, n, "sync")
                await until(lambda: costs.accepted["sync"] + costs.dead["sync"] >= n, 600)
                await publish(producer, settings, n, "batch")
                batch_from = time.monotonic()
                with_batch = await run.live(producer, args.live_rate, args.seconds, "batch")
                await run.wait_for(with_batch, 120)
                await until(lambda: costs.accepted["batch"] + costs.dead["batch"] >= n, 900)
                batches = sim.call("/sim/stats")
            finally:
                await producer.stop()
                stop_reading.set()
                await asyncio.gather(*readers)
                stop(worker)
    finally:
        stop(sim.proc)
    p95_alone = percentile([run.latency[t] for t in alone if t in run.latency], 0.95) * 1000
    p95_batch = percentile([run.latency[t] for t in with_batch if t in run.latency], 0.95) * 1000
    sync_cost, batch_cost = costs.per_task("sync"), costs.per_task("batch")
    print(f"{n} tasks per replay; simulator RPM {args.rpm}, latency 300+-100 ms, batches done "
          f"{args.batch_delay:g} s after creation; live {args.live_rate:g}/s for {args.seconds:g} s")  # fmt: skip
    print(f"{'replay tier':<12} {'accepted':>9} {'dead':>6} {'cost/accepted task':>20}")
    for tier in ("sync", "batch"):
        print(f"{tier:<12} {costs.accepted[tier]:>9} {costs.dead[tier]:>6} "
              f"{'$' + format(costs.per_task(tier), '.8f'):>20}")  # fmt: skip
    print(f"batch / sync cost per accepted task: {batch_cost / sync_cost:.3f} (target <= 0.55)")
    print(f"live p95: alone {p95_alone:.0f} ms, while the batch replay ran {p95_batch:.0f} ms "
          f"-> ratio {p95_batch / p95_alone:.2f}")  # fmt: skip
    if os.environ.get("BENCH_DEBUG"):
        worst = sorted(
            ((run.latency.get(t, 0), run.sent_at[t] - batch_from) for t in with_batch), reverse=True
        )[:25]
        print(
            "slowest live tasks (latency s, sent at s after the batch replay):",
            [(round(a, 2), round(b, 1)) for a, b in worst],
        )
    print(f"simulator: {batches['batches']} batches {batches['batches_by_status']}, "
          f"{batches['batch_items_submitted']} batch requests; logs {logdir}")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
