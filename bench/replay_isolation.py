"""Replay isolation: live-lane latency with and without a 20,000-task replay running.

One run, one broker (Apache Kafka 4.1.1 from jars), one LLM simulator process
with an RPM limit R (latency 300 +- 100 ms), one llm-streams worker. Live
tasks are published at a steady rate (a fraction of R) and their end-to-end
latency is measured by this script (sent -> result read back). Phases:

1. live traffic alone;
2. the same live traffic while 20,000 tasks wait in the replay lane
   (published just before, all at once, as `llm-streams replay` does).

Both phases run once per header style (`x-ratelimit-remaining-*` counted against
the minute, as OpenAI does, and against the enforcing second, as some gateways
do), each on fresh topics with a fresh worker.

Printed: live p50/p95/p99 per phase and the ratio of the p95s (target <= 1.5),
plus how much of R the replay used meanwhile (it should take what live leaves).

    python bench/replay_isolation.py [--rpm 3000] [--live-rate 12.5] [--seconds 60] [--replay 20000]
        [--remaining-windows 60,1]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_overhead import spawn_worker, stop, task_record, warm_up
from rate_limit_utilisation import Sim

from streams.dev.brokers.apache import ApacheKafka
from streams.dev.brokers.common import free_port
from streams.dev.simulator import percentile
from streams.kafka.topics import ensure_topics
from streams.settings import Settings, load_settings


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The worker's /metrics as {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def mean_of(
    metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, lane: str
) -> float:
    total = metrics.get((f"{name}_sum", (("lane", lane),)), 0.0)
    count = metrics.get((f"{name}_count", (("lane", lane),)), 0.0)
    return total / count * 1000 if count else 0.0


class Run:
    """One worker, and a reader of its results that timestamps each live answer."""

    def __init__(self, settings: Settings, logdir: Path) -> None:
        self.settings = settings
        self.logdir = logdir
        self.sent_at: dict[str, float] = {}
        self.latency: dict[str, float] = {}
        self.replay_done: list[float] = []  # arrival times of replay-lane results
        self.dead = 0

    async def read(self, stop_event: asyncio.Event) -> None:
        s = self.settings
        consumer = AIOKafkaConsumer(
            s.topics.results, s.topics.dead_letters, bootstrap_servers=s.bootstrap_servers,
            group_id=f"iso-{uuid.uuid4().hex[:6]}", auto_offset_reset="earliest",
            enable_auto_commit=False,
        )  # fmt: skip
        await consumer.start()
        try:
            while not stop_event.is_set():
                batch = await consumer.getmany(timeout_ms=100)
                now = time.monotonic()
                for tp, records in batch.items():
                    if tp.topic == s.topics.dead_letters:
                        self.dead += len(records)
                        continue
                    for rec in records:
                        result = orjson.loads(rec.value)
                        if result["source"]["topic"] == s.topics.replay:
                            self.replay_done.append(now)
                        elif result["task_id"] in self.sent_at:
                            self.latency.setdefault(
                                result["task_id"], now - self.sent_at[result["task_id"]]
                            )
        finally:
            await consumer.stop()

    async def live(
        self, producer: AIOKafkaProducer, rate: float, seconds: float, tag: str
    ) -> list[str]:
        """Publish live tasks at `rate`/s for `seconds`; return their ids."""
        ids = []
        start = time.monotonic()
        i = 0
        while (elapsed := time.monotonic() - start) < seconds:
            due = int(elapsed * rate) + 1
            while i < due:
                task_id = f"live-{tag}-{i:06d}"
                task = {"task_id": task_id, "pipeline": "comment-analysis",
                        "input": {"text": f"Live {tag} {i}: the handle came loose after a week."}}  # fmt: skip
                self.sent_at[task_id] = time.monotonic()
                await producer.send(self.settings.topics.tasks, key=task_id.encode(),
                                    value=orjson.dumps(task))  # fmt: skip
                ids.append(task_id)
                i += 1
            await asyncio.sleep(0.01)
        return ids

    async def wait_for(self, ids: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not all(t in self.latency for t in ids):
            await asyncio.sleep(0.2)


async def one_style(kafka: ApacheKafka, sim: Sim, args: argparse.Namespace, window_s: float,
                    logdir: Path) -> dict[str, Any]:  # fmt: skip
    """Both phases with the simulator reporting `remaining` against `window_s` seconds,
    on fresh topics with a fresh worker."""
    sim.call("/sim/config", {"remaining_window_s": window_s})
    suffix = uuid.uuid4().hex[:6]
    settings = load_settings(
        app_id=f"iso-{suffix}",
        kafka={"broker_url": kafka.url, "partitions": 4},
        topics={n: f"{n}-{suffix}" for n in ("tasks", "replay", "results", "dead_letters", "review")},
        llm={"base_url": f"{sim.base}/v1", "api_key": sim.KEY, "model": "sim-1",
             "max_attempts": 6, "task_deadline_s": 600},
        batch={"size": 200, "window_s": 0.05, "concurrency": 64, "buffer": args.buffer},
        data_dir=logdir / f"worker-{suffix}",
        log_level="warning",
    )  # fmt: skip
    await ensure_topics(settings)
    web_port = free_port()
    worker = spawn_worker(settings, logdir / f"worker-{suffix}.log", web_port)
    run = Run(settings, logdir)
    stop_reading = asyncio.Event()
    reader = asyncio.create_task(run.read(stop_reading))
    producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap, linger_ms=5, acks=1)
    await producer.start()
    try:
        # Warm the worker up (joins the group, loads the tokenizer) before timing.
        await run.wait_for(await run.live(producer, 5, 3, "warm"), 120)
        sim.reset(args.rpm)
        alone = await run.live(producer, args.live_rate, args.seconds, "alone")
        await run.wait_for(alone, 120)
        # Phase 2: the replay lane fills, then the same live traffic.
        futures = []
        for i in range(args.replay):
            key, value = task_record(i)
            futures.append(await producer.send(settings.topics.replay, key=key, value=value))
        await asyncio.gather(*futures)
        replay_from = time.monotonic()
        with_replay = await run.live(producer, args.live_rate, args.seconds, "replay")
        replay_span = time.monotonic() - replay_from
        await run.wait_for(with_replay, 300)
        replayed = sum(1 for t in run.replay_done if replay_from <= t <= replay_from + replay_span)
        metrics = scrape(web_port)
        stats = sim.call("/sim/stats")
    finally:
        await producer.stop()
        stop_reading.set()
        await reader
        stop(worker)
    return {"run": run, "alone": alone, "with_replay": with_replay, "replayed": replayed,
            "replay_span": replay_span, "metrics": metrics, "stats": stats}  # fmt: skip


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rpm", type=int, default=3000)
    parser.add_argument("--live-rate", type=float, default=12.5, help="live tasks per second")
    parser.add_argument("--seconds", type=float, default=60.0, help="live traffic per phase")
    parser.add_argument("--replay", type=int, default=20000, help="tasks in the replay lane")
    parser.add_argument("--buffer", type=int, default=1024, help="LLM_STREAMS_BATCH__BUFFER")
    parser.add_argument("--remaining-windows", default="60,1",
                        help="header styles: the seconds `remaining` is counted against")  # fmt: skip
    args = parser.parse_args()
    logdir = Path(tempfile.mkdtemp(prefix="llm-streams-iso-"))
    sim = Sim(args.rpm, args.rpm * 2000)
    styles: dict[float, dict[str, Any]] = {}
    try:
        with ApacheKafka(heap_mb=1024) as kafka:
            await warm_up(kafka, 5000)
            for window in (float(w) for w in args.remaining_windows.split(",")):
                styles[window] = await one_style(kafka, sim, args, window, logdir)
    finally:
        stop(sim.proc)
    live_rpm = args.live_rate * 60
    print(f"simulator: RPM limit R={args.rpm}, latency 300+-100 ms; worker concurrency 64; "
          f"live {args.live_rate:g} tasks/s ({live_rpm / args.rpm:.0%} of R) for {args.seconds:g} s per phase")  # fmt: skip
    for window, got in styles.items():
        report(args, window, got)
    print(f"logs: {logdir}")


def report(args: argparse.Namespace, window: float, got: dict[str, Any]) -> None:
    run, metrics = got["run"], got["metrics"]
    print(f"\n== x-ratelimit-remaining-* counted against {window:g} s")

    def row(name: str, ids: list[str]) -> tuple[float, float]:
        lat = [run.latency[t] * 1000 for t in ids if t in run.latency]
        missing = len(ids) - len(lat)
        p50, p95, p99 = percentile(lat, 0.5), percentile(lat, 0.95), percentile(lat, 0.99)
        print(f"{name:<28} {len(lat):>6} {p50:>9.0f} {p95:>9.0f} {p99:>9.0f} {statistics.mean(lat):>9.0f}"
              + (f"   ({missing} unanswered)" if missing else ""))  # fmt: skip
        return p50, p95

    live_rpm = args.live_rate * 60
    print(
        f"{'live lane, end-to-end (ms)':<28} {'tasks':>6} {'p50':>9} {'p95':>9} {'p99':>9} {'mean':>9}"
    )
    _, p95_alone = row("alone", got["alone"])
    _, p95_replay = row(f"with {args.replay} in replay", got["with_replay"])
    print(f"live p95 with replay / alone: {p95_replay / p95_alone:.2f} (target <= 1.5)")
    replayed, span = got["replayed"], got["replay_span"]
    used = (replayed / span * 60 + live_rpm) / args.rpm
    refused = got["stats"]["by_status"].get("429", 0) / max(1, got["stats"]["requests"])
    print(
        f"replay lane meanwhile: {replayed} tasks in {span:.0f} s "
        f"({replayed / span * 60:.0f}/min); live + replay = {used:.2f} of R (target >= 0.95); "
        f"429s {refused:.2%} of requests"
    )
    waits = {
        lane: (mean_of(metrics, "llm_streams_queue_wait_seconds", lane),
               mean_of(metrics, "llm_streams_limiter_wait_seconds", lane))
        for lane in ("live", "replay")
    }  # fmt: skip
    print("mean waits in the worker (both phases), ms: " + ", ".join(
        f"{lane}: slot {q:.0f}, rate limiter {w:.0f}" for lane, (q, w) in waits.items()))  # fmt: skip
    retries = {dict(k[1])["category"]: int(v) for k, v in metrics.items()
               if k[0] == "llm_streams_retries_total"}  # fmt: skip
    print(f"retries by category: {retries or 'none'}; dead letters: {run.dead}")


if __name__ == "__main__":
    asyncio.run(main())
