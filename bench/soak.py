"""Soak: a steady stream with poison of every kind and provider faults, on real Kafka.

One run: Apache Kafka 4.1.1 (jars), the LLM simulator in its own process, two
workers in one group. For `--minutes` (default 30) tasks arrive at `--rate` per
second; 5% of the records are poison, rotating through: records of 2 MB (and,
once a minute, 10 MB) in a topic taking 16 MB, values that are not JSON, invalid
UTF-8 in key and value, keys that are not the task id, 200 headers, answers of
2 MB (over what the results topic takes), tasks of an unknown pipeline. The
provider fails 2% of calls with 500s and hangs 1% of them; one 60-s outage
(every call 503) at 40% of the run; three SIGKILLs of a worker (restarted at
once) at 20%, 55% and 80%. A worker that exits on its own is counted and
restarted (that would be an exit caused by input).

At the end it waits for every input to end and prints, measured in this run:
inputs, results, dead letters by category, worker exits not caused by the
soak's own kills, tasks lost (inputs with no outcome), inputs answered more
than once under different result keys, and the breaker's transitions (from
the workers' logs).

    python bench/soak.py [--minutes 30] [--rate 25]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import orjson
import yaml
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rate_limit_utilisation import Sim

from streams.dev.brokers.apache import ApacheKafka
from streams.dev.brokers.common import free_port
from streams.kafka.topics import ensure_topics
from streams.settings import Settings, load_settings, settings_env

ROOT = Path(__file__).resolve().parents[1]
MB = 1024 * 1024
POISON_SHARE = 0.05
KINDS = ["big", "not_json", "bad_utf8", "other_key", "headers", "long_answer", "unknown"]
TEXTS = ["Great value, works as described.", "Stopped working after two days.",
         "物流很快，东西不错。", "The zip broke but support replaced it."]  # fmt: skip


def pipelines(folder: Path) -> tuple[Path, Path]:
    """The shipped pipelines and a `long-answer` one whose model writes 2 MB."""
    p, s = folder / "pipelines", folder / "schemas"
    shutil.copytree(ROOT / "pipelines", p)
    shutil.copytree(ROOT / "schemas", s)
    spec = {"name": "long-answer", "default_version": "v1",
            "output_schema": "long-answer.output.schema.json",
            "versions": {"v1": {"model": "sim-long", "params": {"max_tokens": 1_500_000},
                                "response_format": "json_schema",
                                "slots": {"text": {"type": "string", "required": True}},
                                "system": "Role: writer. Task: write at length. Constraints: JSON.",
                                "template": "<comment>{{ text }}</comment>"}}}  # fmt: skip
    (p / "long-answer.yaml").write_text(yaml.safe_dump(spec))
    schema = {"type": "object", "required": ["essay"], "properties": {"essay": {"type": "string"}}}
    (s / "long-answer.output.schema.json").write_bytes(orjson.dumps(schema))
    return p, s


class Worker:
    def __init__(self, settings: Settings, name: str, logdir: Path) -> None:
        self.settings, self.name, self.logdir = settings, name, logdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.lives = 0

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_STREAMS_")}
        env.update(settings_env(self.settings))
        env["LLM_STREAMS_WEB_PORT"] = str(free_port())
        env["LLM_STREAMS_DATA_DIR"] = str(self.logdir / f"{self.name}-data")
        self.lives += 1
        with open(self.logdir / f"{self.name}-{self.lives}.log", "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "streams.cli", "worker"],
                                         env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()


def record(i: int, kind: str | None) -> tuple[bytes | None, bytes, list[tuple[str, bytes]], str]:
    """(key, value, headers, id) of input i; id names the input in the accounting."""
    tid = f"soak-{i:07d}"
    text = f"{TEXTS[i % len(TEXTS)]} ({i})"

    def task(pipeline: str = "comment-analysis", body: str = text) -> bytes:
        return orjson.dumps({"task_id": tid, "pipeline": pipeline, "input": {"text": body}})

    if kind == "big":
        size = 10 * MB if (i // 140) % 10 == 0 else 2 * MB  # one big record in ten: 10 MB
        return tid.encode(), task(body="x" * size), [], tid
    if kind == "not_json":
        return tid.encode(), b"plain text, not a task " + tid.encode(), [], tid
    if kind == "bad_utf8":
        return b"\xff\xfe" + tid.encode(), b"\xff\xfe" + tid.encode(), [], tid
    if kind == "other_key":
        return f"other-{i}".encode(), task(), [], tid
    if kind == "headers":
        return tid.encode(), task(), [(f"x-h-{n}", b"v" * 20) for n in range(200)], tid
    if kind == "long_answer":
        return tid.encode(), task("long-answer", "tell me everything"), [], tid
    if kind == "unknown":
        return tid.encode(), task("no-such-pipeline"), [], tid
    return tid.encode(), task(), [], tid


async def produce(settings: Settings, minutes: float, rate: float,
                  offsets: dict[tuple[int, int], str]) -> int:  # fmt: skip
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap_servers, acks="all",
                                linger_ms=5, max_request_size=16 * MB)  # fmt: skip
    await producer.start()
    started = time.monotonic()
    i = 0
    try:
        while time.monotonic() - started < minutes * 60:
            due = int((time.monotonic() - started) * rate)
            while i < due:
                kind = KINDS[(i // 20) % len(KINDS)] if i % 20 == 7 else None  # 5% poison
                key, value, headers, ident = record(i, kind)
                meta = await (await producer.send(settings.topics.tasks, key=key, value=value,
                                                  headers=headers))  # fmt: skip
                offsets[(meta.partition, meta.offset)] = ident
                i += 1
            await asyncio.sleep(0.05)
    finally:
        await producer.stop()
    return i


async def collect(settings: Settings, ids: set[str], timeout_s: float) -> dict[str, list[Any]]:
    """Outcomes by input id (a task id, or the key of a record without one)."""
    consumer = AIOKafkaConsumer(settings.topics.results, settings.topics.dead_letters,
                                bootstrap_servers=settings.bootstrap_servers,
                                group_id=f"soak-{uuid.uuid4().hex[:6]}",
                                auto_offset_reset="earliest", enable_auto_commit=False,
                                max_partition_fetch_bytes=16 * MB)  # fmt: skip
    await consumer.start()
    out: dict[str, list[Any]] = defaultdict(list)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and not ids <= set(out):
            batch = await consumer.getmany(timeout_ms=1000)
            for records in batch.values():
                for rec in records:
                    data = orjson.loads(rec.value)
                    ident = data.get("task_id")
                    if ident is None:  # not UTF-8: its value (b"\xff\xfe" + id) says
                        raw = (data.get("payload") or {}).get("raw_base64")
                        ident = base64.b64decode(raw)[2:].decode() if raw else "?"
                    kind = "result" if rec.topic == settings.topics.results else \
                        data["error"]["category"]  # fmt: skip
                    out[ident].append((kind, data.get("result_key")))
        return out
    finally:
        await consumer.stop()


def breaker_transitions(logdir: Path) -> Counter[str]:
    found: Counter[str] = Counter()
    for path in logdir.glob("*.log"):
        for line in path.read_text(errors="replace").splitlines():
            m = re.search(r"circuit \S+: (\w+) -> (\w+)", line)
            if m:
                found[f"{m.group(1)}->{m.group(2)}"] += 1
    return found


async def main(minutes: float, rate: float) -> None:
    logdir = Path(tempfile.mkdtemp(prefix="soak-"))
    p, s = pipelines(logdir)
    sim = Sim(rpm=0, tpm=0, latency_ms=300, jitter_ms=100, error_rate=0.02)
    sim.call("/sim/config", {"hang_rate": 0.01, "hang_s": 600, "models": ["sim-1", "sim-long"],
                             "long_answer_models": ["sim-long"], "long_answer_chars": 2 * MB,
                             "context_window": 4_000_000})  # fmt: skip
    with ApacheKafka(heap_mb=1024) as kafka:
        suffix = uuid.uuid4().hex[:6]
        settings = load_settings(
            app_id=f"soak-{suffix}",
            kafka={"broker_url": kafka.url, "partitions": 4, "session_timeout_s": 10},
            topics={n: f"{n}-{suffix}" for n in ("tasks", "replay", "results", "dead_letters", "review")},
            llm={"base_url": f"{sim.base}/v1", "api_key": sim.KEY, "model": "sim-1",
                 "read_timeout_s": 10, "task_deadline_s": 120, "context_window": 4_000_000},
            batch={"concurrency": 64},
            pipelines_dir=p, schemas_dir=s, log_level="info",
        )  # fmt: skip
        admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap_servers)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(settings.topics.tasks, 4, 1,
                                                topic_configs={"max.message.bytes": str(16 * MB)})])  # fmt: skip
        finally:
            await admin.close()
        await ensure_topics(settings)
        workers = [Worker(settings, f"w{n}", logdir) for n in range(2)]
        for w in workers:
            w.start()
        offsets: dict[tuple[int, int], str] = {}
        own_kills = 0
        unexpected_exits: list[str] = []
        producing = asyncio.create_task(produce(settings, minutes, rate, offsets))
        started = time.monotonic()
        plan = sorted([(0.2, "kill"), (0.4, "outage"), (0.55, "kill"), (0.8, "kill")])
        outage_until: float | None = None
        while not producing.done():
            elapsed = (time.monotonic() - started) / (minutes * 60)
            if plan and elapsed >= plan[0][0]:
                _, what = plan.pop(0)
                if what == "kill":
                    victim = workers[own_kills % 2]
                    victim.kill()
                    own_kills += 1
                    victim.start()
                    print(f"[{time.monotonic() - started:6.0f}s] SIGKILL {victim.name}", flush=True)
                else:
                    sim.call("/sim/config", {"error_503_rate": 1.0})
                    outage_until = time.monotonic() + 60
                    print(f"[{time.monotonic() - started:6.0f}s] outage: 60 s of 503s", flush=True)
            if outage_until is not None and time.monotonic() >= outage_until:
                sim.call("/sim/config", {"error_503_rate": 0.0})
                outage_until = None
            for w in workers:
                if not w.alive():
                    unexpected_exits.append(w.name)
                    print(f"worker {w.name} exited on its own; restarting", flush=True)
                    w.start()
            await asyncio.sleep(1)
        sent = await producing
        if outage_until is not None:  # the outage lasts its 60 s even past the last input
            await asyncio.sleep(max(0.0, outage_until - time.monotonic()))
            sim.call("/sim/config", {"error_503_rate": 0.0})
        print(f"produced {sent} inputs in {minutes:g} min; waiting for every outcome", flush=True)
        ids = set(offsets.values())
        outcomes = await collect(settings, ids, timeout_s=900)
        for w in workers:
            w.stop()

    lost = ids - set(outcomes)
    results = sum(1 for o in outcomes.values() if any(k == "result" for k, _ in o))
    categories: Counter[str] = Counter()
    two_keys = 0
    both = 0
    for o in outcomes.values():
        kinds = {k for k, _ in o}
        keys = {rk for k, rk in o if k == "result"}
        two_keys += len(keys) > 1
        both += "result" in kinds and len(kinds) > 1
        for k in kinds - {"result"}:
            categories[k] += 1
    print("\n== soak ==")
    print(
        f"minutes {minutes:g}, inputs {len(ids)} ({sent} records), poison share {POISON_SHARE:.0%}"
    )
    print(f"results {results}, dead letters {sum(categories.values())}: {dict(categories)}")
    print(
        f"worker exits caused by input: {len(unexpected_exits)} (the soak's own SIGKILLs: {own_kills})"
    )
    print(f"tasks lost: {len(lost)} {sorted(lost)[:5]}")
    print(
        f"inputs answered under two result keys: {two_keys}; with a result and a dead letter: {both}"
    )
    print(f"breaker transitions: {dict(breaker_transitions(logdir))}")
    print(f"logs: {logdir}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=25.0)
    args = parser.parse_args()
    asyncio.run(main(args.minutes, args.rate))
