"""Latency a worker adds to a task beyond its LLM call, against what Kafka itself adds.

One run, one broker (Apache Kafka 4.1.1 from jars, KRaft, 4 partitions; or `--broker
tansu`, the demo's), paced traffic through two processes started side by side:

- **pass-through**: `bench/passthrough_app.py`, a bare Faust agent A -> B on the app's own
  loop, each write awaited until the broker acks it (as the worker writes): produce ->
  consume -> produce -> consume, the least a Faust worker adds to a record;
- **worker**: `llm-streams worker` on its default settings (the limit not told) against the
  simulator answering every call in exactly `--latency-ms` (no jitter).

At `--rate` tasks/s, then at half the simulator's RPM limit (`--rpm`), each rate's tasks
go in `--rounds` rounds that alternate between the two (pass-through first in odd rounds,
the worker first in even ones): a host whose pace drifts from minute to minute (two
cores shared with the broker and the simulator) bills both alike, where one phase after
the other billed whichever met the slow minute. The idle one waits meanwhile.

A task's added latency = its result readable - its record produced - the LLM's own time:
the simulator's median time from a request's arrival to its answer over that rate's
rounds (its fixed latency and its own work — tokenizing, JSON —, as it says in
`openai-processing-ms`), and, printed beside it, the fixed latency alone (the simulator's
work counted against the worker). Prints p50 / p99 of both and the ratio worker-added /
pass-through.

    python bench/latency.py [--tasks 600] [--rounds 4] [--rate 10] [--rpm 3000]
                            [--latency-ms 300] [--broker kafka|tansu]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Self

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


async def until(done: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:  # type: ignore[operator]
        await asyncio.sleep(0.1)
    if not done():  # type: ignore[operator]
        raise RuntimeError(f"timed out waiting for {what}")


class Started:
    """A process under test and what watches it, started on `async with` and stopped on
    its way out — or when starting failed, what had started by then."""

    def __init__(self) -> None:
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Self:
        try:
            await self._start()
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def _start(self) -> None:
        raise NotImplementedError


class PassThrough(Started):
    """A bare Faust pass-through and a reader timestamping what comes out of it."""

    def __init__(self, kafka: ApacheKafka | TansuBroker, logdir: Path) -> None:
        self.kafka, self.logdir = kafka, logdir
        self.suffix = uuid.uuid4().hex[:6]
        self.source, self.sink = f"lat-in-{self.suffix}", f"lat-out-{self.suffix}"
        self.sent_at: dict[str, float] = {}
        self.took: dict[str, float] = {}
        super().__init__()

    async def _start(self) -> None:
        kafka, suffix = self.kafka, self.suffix
        await create_topic(kafka.bootstrap, self.source)
        await create_topic(kafka.bootstrap, self.sink)
        env = {**os.environ, "BENCH_BROKER": kafka.url, "BENCH_SOURCE": self.source,
               "BENCH_SINK": self.sink, "BENCH_APP_ID": f"lat-{suffix}",
               "BENCH_WEB_PORT": str(free_port()), "BENCH_ACKED": "1", "BENCH_IN_LOOP": "1"}  # fmt: skip
        with open(self.logdir / f"passthrough-{suffix}.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, str(HERE / "passthrough_app.py")], env=env,
                                    stdout=log, stderr=subprocess.STDOUT, cwd=self.logdir)  # fmt: skip
        self._stack.callback(stop, proc)
        consumer = AIOKafkaConsumer(self.sink, bootstrap_servers=kafka.bootstrap,
                                    group_id=f"lat-read-{suffix}", auto_offset_reset="earliest",
                                    enable_auto_commit=False)  # fmt: skip
        await consumer.start()
        self._stack.push_async_callback(consumer.stop)
        self.producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap, linger_ms=0, acks=1)
        await self.producer.start()
        self._stack.push_async_callback(self.producer.stop)
        reader = asyncio.create_task(self._read(consumer))
        self._stack.callback(reader.cancel)
        await group_stable(load_settings(app_id=f"lat-{suffix}",
                                         kafka={"broker_url": kafka.url}), 1)  # fmt: skip

    async def _read(self, consumer: AIOKafkaConsumer) -> None:
        while True:
            batch = await consumer.getmany(timeout_ms=50)
            now = time.monotonic()
            for records in batch.values():
                for rec in records:
                    key = rec.key.decode()
                    if key in self.sent_at:
                        self.took.setdefault(key, (now - self.sent_at[key]) * 1000)

    async def measure(self, rate: float, n: int, tag: str) -> list[float]:
        """Milliseconds from produce to readable on its far side, for `n` records."""
        ids = await paced(self.producer, self.source, rate, n, tag, self.sent_at)
        await until(lambda: all(t in self.took for t in ids), 120, "the pass-through's outputs")
        return [self.took[t] for t in ids]


class Worker(Started):
    """An `llm-streams worker` against the simulator, and a reader of its results."""

    def __init__(self, kafka: ApacheKafka | TansuBroker, sim: Sim, logdir: Path,
                 fetch_wait_ms: int | None) -> None:  # fmt: skip
        self.kafka, self.sim, self.logdir = kafka, sim, logdir
        suffix = uuid.uuid4().hex[:6]
        self.settings = load_settings(
            app_id=f"lat-{suffix}",
            kafka={"broker_url": kafka.url, "partitions": 4,
                   **({"fetch_max_wait_ms": fetch_wait_ms} if fetch_wait_ms else {})},
            topics={n: f"{n}-{suffix}" for n in ("tasks", "replay", "results", "dead_letters", "review")},
            llm={"base_url": f"{sim.base}/v1", "api_key": sim.KEY, "model": "sim-1"},
            data_dir=logdir / f"worker-{suffix}",
            log_level="warning",
        )  # fmt: skip
        self.log = logdir / f"worker-{suffix}.log"
        self.run = Run(self.settings, logdir)
        super().__init__()

    async def _start(self) -> None:
        await ensure_topics(self.settings)
        self._stack.callback(stop, spawn_worker(self.settings, self.log))
        stop_reading = asyncio.Event()
        reader = asyncio.create_task(self.run.read(stop_reading))

        async def stop_reader() -> None:
            stop_reading.set()
            await reader

        self._stack.push_async_callback(stop_reader)
        self.producer = AIOKafkaProducer(bootstrap_servers=self.kafka.bootstrap, linger_ms=0,
                                         acks=1)  # fmt: skip
        await self.producer.start()
        self._stack.push_async_callback(self.producer.stop)
        await group_stable(self.settings, 1)

    async def measure(self, rate: float, n: int, tag: str) -> list[float]:
        """Milliseconds from each task's record produced to its result readable."""
        ids = await paced(self.producer, self.settings.topics.tasks, rate, n, tag,
                          self.run.sent_at)  # fmt: skip
        await self.run.wait_for(ids, 300)
        missing = [t for t in ids if t not in self.run.latency]
        if missing:
            raise RuntimeError(f"{len(missing)} tasks unanswered; logs in {self.logdir}")
        return [self.run.latency[t] * 1000 for t in ids]


async def one_rate(pt: PassThrough, wk: Worker, sim: Sim, rate: float, n: int, rounds: int,
                   rpm: int) -> tuple[list[float], list[float], float]:  # fmt: skip
    """Both at `rate` in alternating rounds: the pass-through's milliseconds, the worker's,
    and the simulator's median time per answer over the worker's rounds."""
    sim.reset(rpm)
    # Warm up both (the tokenizer, the limiter's first word from the simulator) untimed.
    warm = max(20, int(rate * 3))
    await pt.measure(rate, warm, f"warm-pt-{rate:g}")
    await wk.measure(rate, warm, f"warm-w-{rate:g}")
    passed: list[float] = []
    added: list[float] = []
    for r in range(rounds):
        share = n // rounds + (1 if r < n % rounds else 0)
        first, second = (pt, wk) if r % 2 == 0 else (wk, pt)
        for who in (first, second):
            took = await who.measure(rate, share, f"{'pt' if who is pt else 'w'}-{rate:g}-{r}")
            (passed if who is pt else added).extend(took)
    own_ms = float(sim.call("/sim/stats")["service_ms"]["p50"])
    return passed, added, own_ms


def shown(ms: list[float]) -> str:
    return f"p50 {percentile(ms, 0.5):7.1f} ms   p99 {percentile(ms, 0.99):7.1f} ms"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=600, help="Timed tasks per rate, each.")
    parser.add_argument("--rounds", type=int, default=4,
                        help="Alternating rounds the tasks of a rate are split into.")  # fmt: skip
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
    rows: list[tuple[float, list[float], list[float], float]] = []
    dead = 0
    try:
        broker = TansuBroker() if args.broker == "tansu" else ApacheKafka(heap_mb=1024)
        with broker as kafka:
            if isinstance(kafka, ApacheKafka):  # its JIT would bill the first phase
                await warm_up(kafka, 10_000)
            async with PassThrough(kafka, logdir) as pt, \
                    Worker(kafka, sim, logdir, args.fetch_max_wait_ms) as wk:  # fmt: skip
                for rate in rates:
                    rows.append((rate, *await one_rate(pt, wk, sim, rate, args.tasks,
                                                       args.rounds, args.rpm)))  # fmt: skip
                dead = wk.run.dead
    finally:
        stop(sim.proc)
    what = "Tansu (the demo's broker)" if args.broker == "tansu" else "Apache Kafka 4.1.1 (KRaft)"
    print(f"{what}, 4 partitions; simulator at exactly {args.latency_ms:g} ms per call, "
          f"{args.rpm} RPM; {args.tasks} timed tasks per rate each, in {args.rounds} "
          f"alternating rounds; dead letters {dead}; logs {logdir}")  # fmt: skip
    for rate, pt_ms, took, own_ms in rows:
        added = [ms - own_ms for ms in took]
        fixed = [ms - args.latency_ms for ms in took]
        print(f"at {rate:g} tasks/s (the simulator's own time per answer: {own_ms:.1f} ms at p50):")
        print(f"  bare Faust pass-through, produce -> readable : {shown(pt_ms)}")
        print(f"  worker, added beyond the LLM's own time      : {shown(added)}")
        print(f"  ratio worker-added / pass-through            : p50 "
              f"{percentile(added, 0.5) / percentile(pt_ms, 0.5):.2f}   p99 "
              f"{percentile(added, 0.99) / percentile(pt_ms, 0.99):.2f}")  # fmt: skip
        print(f"  (beyond the fixed {args.latency_ms:g} ms alone: {shown(fixed)}, ratio p50 "
              f"{percentile(fixed, 0.5) / percentile(pt_ms, 0.5):.2f}   p99 "
              f"{percentile(fixed, 0.99) / percentile(pt_ms, 0.99):.2f})")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
