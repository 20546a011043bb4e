"""Latency a worker adds to a task beyond its LLM call, against what Kafka itself adds.

One run, one broker (Apache Kafka 4.1.1 from jars, KRaft, 4 partitions; or `--broker
tansu`, the demo's), paced traffic:

- **pass-through**: `bench/passthrough_app.py`, a bare Faust agent A -> B on the app's own
  loop, each write awaited until the broker acks it (as the worker writes): produce ->
  consume -> produce -> consume, the least a Faust worker adds to a record;
- **worker**: `llm-streams worker` on its default settings (the limit not told) against the
  simulator answering every call in exactly `--latency-ms` (no jitter).

Each at `--rate` tasks/s, then at half the simulator's RPM limit (`--rpm`). A task's added
latency = its result readable - its record produced - the LLM's own time: the simulator's
median time from a request's arrival to its answer in that phase (its fixed latency and
its own work — tokenizing, JSON —, as it says in `openai-processing-ms`), and, printed
beside it, the fixed latency alone (the simulator's work counted against the worker).
Prints p50 / p99 of both and the ratio worker-added / pass-through.

    python bench/latency.py [--tasks 600] [--rate 10] [--rpm 3000] [--latency-ms 300]
                            [--broker kafka|tansu]
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
from pipeline_overhead import create_topic, group_stable, spawn_worker, stop, warm_up
from rate_limit_utilisation import Sim
from replay_isolation import Run, percentile

from streams.dev.brokers.apache import ApacheKafka
from streams.dev.brokers.common import free_port
from streams.dev.brokers.tansu import TansuBroker
from streams.kafka.topics import ensure_topics
from streams.settings import load_settings

HERE = Path(__file__).resolve().parent


async def paced(producer: AIOKafkaProducer, topic: str, rate: float, n: int, tag: str,
                sent_at: dict[str, float]) -> list[str]:  # fmt: skip
    """`n` comment-analysis tasks at `rate`/s, each timestamped as it is handed over."""
    ids = []
    start = time.monotonic()
    for i in range(n):
        await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
        task_id = f"{tag}-{i:06d}"
        task = {"task_id": task_id, "pipeline": "comment-analysis",
                "input": {"text": f"Order {tag} {i}: the handle came loose after a week."}}  # fmt: skip
        sent_at[task_id] = time.monotonic()
        await producer.send(topic, key=task_id.encode(), value=orjson.dumps(task))
        ids.append(task_id)
    return ids


async def passthrough(
    kafka: ApacheKafka | TansuBroker, rate: float, n: int, logdir: Path
) -> list[float]:
    """Milliseconds from produce to readable on the far side of a bare Faust pass-through."""
    suffix = uuid.uuid4().hex[:6]
    source, sink = f"lat-in-{suffix}", f"lat-out-{suffix}"
    await create_topic(kafka.bootstrap, source)
    await create_topic(kafka.bootstrap, sink)
    env = {**os.environ, "BENCH_BROKER": kafka.url, "BENCH_SOURCE": source,
           "BENCH_SINK": sink, "BENCH_APP_ID": f"lat-{suffix}",
           "BENCH_WEB_PORT": str(free_port()), "BENCH_ACKED": "1", "BENCH_IN_LOOP": "1"}  # fmt: skip
    with open(logdir / f"passthrough-{suffix}.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, str(HERE / "passthrough_app.py")], env=env,
                                stdout=log, stderr=subprocess.STDOUT, cwd=logdir)  # fmt: skip
    sent_at: dict[str, float] = {}
    took: dict[str, float] = {}
    consumer = AIOKafkaConsumer(sink, bootstrap_servers=kafka.bootstrap,
                                group_id=f"lat-read-{suffix}", auto_offset_reset="earliest",
                                enable_auto_commit=False)  # fmt: skip
    producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap, linger_ms=0, acks=1)
    await consumer.start()
    await producer.start()

    async def read() -> None:
        while True:
            batch = await consumer.getmany(timeout_ms=50)
            now = time.monotonic()
            for records in batch.values():
                for rec in records:
                    key = rec.key.decode()
                    if key in sent_at:
                        took.setdefault(key, (now - sent_at[key]) * 1000)

    reader = asyncio.create_task(read())
    try:
        await group_stable(load_settings(app_id=f"lat-{suffix}",
                                         kafka={"broker_url": kafka.url}), 1)  # fmt: skip
        warm = await paced(producer, source, rate, max(20, int(rate * 3)), "warm", sent_at)
        await until(lambda: all(t in took for t in warm), 60)
        ids = await paced(producer, source, rate, n, "pt", sent_at)
        await until(lambda: all(t in took for t in ids), 120)
        return [took[t] for t in ids]
    finally:
        reader.cancel()
        await producer.stop()
        await consumer.stop()
        stop(proc)


async def worker(kafka: ApacheKafka | TansuBroker, sim: Sim, rate: float, n: int,
                 logdir: Path, fetch_wait_ms: int | None) -> tuple[list[float], int, float]:  # fmt: skip
    """Milliseconds from each task's record produced to its result readable; dead letters;
    the simulator's median time per answer meanwhile (the LLM's own time)."""
    suffix = uuid.uuid4().hex[:6]
    settings = load_settings(
        app_id=f"lat-{suffix}",
        kafka={"broker_url": kafka.url, "partitions": 4,
               **({"fetch_max_wait_ms": fetch_wait_ms} if fetch_wait_ms else {})},
        topics={n: f"{n}-{suffix}" for n in ("tasks", "replay", "results", "dead_letters", "review")},
        llm={"base_url": f"{sim.base}/v1", "api_key": sim.KEY, "model": "sim-1"},
        data_dir=logdir / f"worker-{suffix}",
        log_level="warning",
    )  # fmt: skip
    await ensure_topics(settings)
    proc = spawn_worker(settings, logdir / f"worker-{suffix}.log")
    run = Run(settings, logdir)
    stop_reading = asyncio.Event()
    reader = asyncio.create_task(run.read(stop_reading))
    producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap, linger_ms=0, acks=1)
    await producer.start()
    try:
        await group_stable(settings, 1)
        # Warm up (the tokenizer, the limiter's first word from the simulator) untimed.
        warm = await paced(producer, settings.topics.tasks, rate, max(20, int(rate * 3)),
                           "warm", run.sent_at)  # fmt: skip
        await run.wait_for(warm, 120)
        ids = await paced(producer, settings.topics.tasks, rate, n, "live", run.sent_at)
        await run.wait_for(ids, 300)
        missing = [t for t in ids if t not in run.latency]
        if missing:
            raise RuntimeError(f"{len(missing)} tasks unanswered; logs in {logdir}")
        own_ms = float(sim.call("/sim/stats")["service_ms"]["p50"])
        return [run.latency[t] * 1000 for t in ids], run.dead, own_ms
    finally:
        stop_reading.set()
        await reader
        await producer.stop()
        stop(proc)


async def until(done: object, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:  # type: ignore[operator]
        await asyncio.sleep(0.1)
    if not done():  # type: ignore[operator]
        raise RuntimeError("timed out waiting for the pass-through's outputs")


def shown(ms: list[float]) -> str:
    return f"p50 {percentile(ms, 0.5):7.1f} ms   p99 {percentile(ms, 0.99):7.1f} ms"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=600, help="Timed tasks per phase.")
    parser.add_argument("--rate", type=float, default=10.0, help="Tasks/s of the first phase.")
    parser.add_argument("--rpm", type=int, default=3000, help="The simulator's RPM limit.")
    parser.add_argument("--latency-ms", type=float, default=300.0)
    parser.add_argument("--broker", choices=["kafka", "tansu"], default="kafka",
                        help="Apache Kafka from jars, or the demo's Tansu (make run's).")  # fmt: skip
    parser.add_argument("--fetch-max-wait-ms", type=int, default=None,
                        help="The worker's LLM_STREAMS_KAFKA__FETCH_MAX_WAIT_MS (default: its own).")  # fmt: skip
    args = parser.parse_args()
    logdir = Path(tempfile.mkdtemp(prefix="llm-streams-latency-"))
    rates = [args.rate, args.rpm / 60 / 2]
    sim = Sim(args.rpm, 0, latency_ms=int(args.latency_ms), jitter_ms=0, error_rate=0.0)
    rows = []
    try:
        broker = TansuBroker() if args.broker == "tansu" else ApacheKafka(heap_mb=1024)
        with broker as kafka:
            if isinstance(kafka, ApacheKafka):  # its JIT would bill the first phase
                await warm_up(kafka, 10_000)
            for rate in rates:
                pt = await passthrough(kafka, rate, args.tasks, logdir)
                sim.reset(args.rpm)
                took, dead, own_ms = await worker(kafka, sim, rate, args.tasks, logdir,
                                                  args.fetch_max_wait_ms)  # fmt: skip
                rows.append((rate, pt, took, dead, own_ms))
    finally:
        stop(sim.proc)
    what = "Tansu (the demo's broker)" if args.broker == "tansu" else "Apache Kafka 4.1.1 (KRaft)"
    print(f"{what}, 4 partitions; simulator at exactly {args.latency_ms:g} ms per call, "
          f"{args.rpm} RPM; {args.tasks} timed tasks per phase; logs {logdir}")  # fmt: skip
    for rate, pt, took, dead, own_ms in rows:
        added = [ms - own_ms for ms in took]
        fixed = [ms - args.latency_ms for ms in took]
        print(f"at {rate:g} tasks/s (the simulator's own time per answer: {own_ms:.1f} ms at p50):")
        print(f"  bare Faust pass-through, produce -> readable : {shown(pt)}")
        print(f"  worker, added beyond the LLM's own time      : {shown(added)}   "
              f"dead letters {dead}")  # fmt: skip
        print(f"  ratio worker-added / pass-through            : p50 "
              f"{percentile(added, 0.5) / percentile(pt, 0.5):.2f}   p99 "
              f"{percentile(added, 0.99) / percentile(pt, 0.99):.2f}")  # fmt: skip
        print(f"  (beyond the fixed {args.latency_ms:g} ms alone: {shown(fixed)}, ratio p50 "
              f"{percentile(fixed, 0.5) / percentile(pt, 0.5):.2f}   p99 "
              f"{percentile(fixed, 0.99) / percentile(pt, 0.99):.2f})")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
