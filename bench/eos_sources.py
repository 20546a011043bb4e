"""Exactly-once from a source topic to a sink, under SIGKILLs, on real Kafka.

One run: Apache Kafka 4.1.1 (jars), the LLM simulator in its own process, two
workers in one group with `exactly_once`. `--records` (default 3,000) plain JSON
comments arrive on a source topic of 3 partitions at `--rate` a second; a
pipeline reads it (`source:`) and writes each answer to a sink topic keyed by the
source record's key. `--kills` (default 5) SIGKILLs of a worker, restarted at once,
spread over the run — most while source records are being forwarded, so each kill
forwards again what its source offsets had not committed.

At the end it waits until the sink holds every key (read_committed) and prints,
measured in this run: the records forwarded to `llm-tasks` (more than the source
records: forwarded again after a kill), and per topic read with read_committed —
the sink and `llm-results` — records, distinct keys, keys seen twice, keys missing.
Exactly-once holds when both say 0 twice and 0 missing.

    python bench/eos_sources.py [--records 3000] [--rate 50] [--kills 5]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rate_limit_utilisation import Sim
from soak import Worker

from streams.contract.headers import SOURCE_OF_HEADER
from streams.dev.brokers.apache import ApacheKafka
from streams.kafka.topics import ensure_topics
from streams.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parents[1]


def pipelines(folder: Path, source: str, sink: str) -> Path:
    """The shipped pipelines and the plain-comments example reading `source` into `sink`."""
    p = folder / "pipelines"
    shutil.copytree(ROOT / "pipelines", p)
    text = (ROOT / "examples" / "sources" / "plain-comments.yaml").read_text()
    text = text.replace("[app.comments]", f"[{source}]")
    text += f"sink:\n  topic: {sink}\n  shape: output\n  key: source_key\n"
    (p / "plain-comments.yaml").write_text(text)
    return p


async def publish(settings: Settings, source: str, keys: list[str], rate: float) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap_servers, acks="all")
    await producer.start()
    started = time.monotonic()
    try:
        for i, key in enumerate(keys):
            value = {"comment": {"text": f"Comment {i}: fine kettle, loud lid."}}
            await producer.send(source, key=key.encode(), value=orjson.dumps(value))
            await asyncio.sleep(max(0.0, started + (i + 1) / rate - time.monotonic()))
        await producer.flush()
    finally:
        await producer.stop()


async def read(settings: Settings, topic: str, *, committed: bool) -> list[Any]:
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=settings.bootstrap_servers,
        group_id=f"eos-bench-{uuid.uuid4().hex[:6]}", auto_offset_reset="earliest",
        enable_auto_commit=False,
        isolation_level="read_committed" if committed else "read_uncommitted",
    )  # fmt: skip
    await consumer.start()
    records: list[Any] = []
    try:
        while batch := await consumer.getmany(timeout_ms=2000):
            for part in batch.values():
                records += part
        return records
    finally:
        await consumer.stop()


def accounting(name: str, keys: list[str], found: list[str]) -> str:
    seen = Counter(found)
    twice = sum(1 for n in seen.values() if n > 1)
    missing = len(set(keys) - set(seen))
    return (f"{name}: {len(found)} records, {len(seen)} keys, {twice} keys twice, "
            f"{missing} missing")  # fmt: skip


async def main(records: int, rate: float, kills: int) -> int:
    logdir = Path(tempfile.mkdtemp(prefix="eos-sources-"))
    sim = Sim(rpm=0, tpm=0, latency_ms=100, jitter_ms=50, error_rate=0.0)
    suffix = uuid.uuid4().hex[:6]
    source, sink = f"app.comments-{suffix}", f"app.comments.answers-{suffix}"
    with ApacheKafka(heap_mb=1024) as kafka:
        settings = load_settings(
            app_id=f"eos-bench-{suffix}",
            kafka={"broker_url": kafka.url, "partitions": 4, "session_timeout_s": 6,
                   "commit_interval_s": 2.0},
            topics={n: f"{n}-{suffix}" for n in ("tasks", "replay", "results", "dead_letters",
                                                  "review")},
            llm={"base_url": f"{sim.base}/v1", "api_key": sim.KEY, "model": "sim-1"},
            batch={"concurrency": 32}, processing_guarantee="exactly_once",
            pipelines_dir=pipelines(logdir, source, sink), log_level="info",
        )  # fmt: skip
        await ensure_topics(settings)
        admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap_servers)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(source, num_partitions=3, replication_factor=1)])
        finally:
            await admin.close()
        keys = [f"c-{i:05d}" for i in range(records)]
        workers = [Worker(settings, f"w{n}", logdir) for n in range(2)]
        for w in workers:
            w.start()
        await asyncio.sleep(15)  # both joined
        started = time.monotonic()
        publishing = asyncio.create_task(publish(settings, source, keys, rate))
        span = records / rate
        for k in range(kills):  # spread over the publishing, at 10% .. 90%
            due = started + span * (0.1 + 0.8 * k / max(1, kills - 1))
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            victim = workers[k % 2]
            victim.kill()
            victim.start()
            print(f"[{time.monotonic() - started:5.0f}s] SIGKILL {victim.name}", flush=True)
        await publishing
        print(f"published {records} source records in {time.monotonic() - started:.0f} s; "
              "waiting for every answer", flush=True)  # fmt: skip
        deadline = time.monotonic() + 600
        answered: list[Any] = []
        while time.monotonic() < deadline:
            answered = await read(settings, sink, committed=True)
            if len({r.key for r in answered}) >= records:
                break
            await asyncio.sleep(5)
        await asyncio.sleep(10)  # a second write of anything would show by now
        answered = await read(settings, sink, committed=True)
        results = await read(settings, settings.topics.results, committed=True)
        forwards = await read(settings, settings.topics.tasks, committed=False)
        for w in workers:
            w.stop()
    sim.proc.terminate()
    forwarded = sum(1 for r in forwards if any(k == SOURCE_OF_HEADER for k, _ in r.headers))
    print("\n== exactly-once from a source ==")
    print(f"source records {records}, SIGKILLs {kills}, forwarded to llm-tasks {forwarded} "
          f"({forwarded - records} again after a kill)")  # fmt: skip
    print(accounting("sink (read_committed)", keys, [r.key.decode() for r in answered]))
    task_ids = [orjson.loads(r.value)["task_id"] for r in results if r.value]
    print(accounting("llm-results (read_committed)", keys, task_ids))
    print(f"logs: {logdir}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=3000)
    parser.add_argument("--rate", type=float, default=50.0)
    parser.add_argument("--kills", type=int, default=5)
    args = parser.parse_args()
    sys.exit(asyncio.run(main(args.records, args.rate, args.kills)))
