"""Run workers as real processes and read what they wrote."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import fastavro
import orjson
from aiokafka import TopicPartition
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from prometheus_client.parser import text_string_to_metric_families

from streams.contract.records import json_object
from streams.dev.brokers.common import free_port
from streams.kafka import clients
from streams.kafka.topics import ensure_topics
from streams.settings import Settings, settings_env


class WorkerProcess:
    """`llm-streams worker` in a child process with the given settings."""

    def __init__(self, settings: Settings, log_path: Path) -> None:
        self.settings = settings
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.web_port = 0

    def start(self) -> WorkerProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_STREAMS_")}
        env.update(settings_env(self.settings))
        self.web_port = free_port()
        env["LLM_STREAMS_WEB_PORT"] = str(self.web_port)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "streams.cli", "worker"],
                env=env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        return self

    def kill(self) -> None:
        """SIGKILL: no shutdown, no commit."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    async def scrape(self) -> Scrape:
        """The worker's /metrics, parsed."""
        url = f"http://127.0.0.1:{self.web_port}/metrics"

        def get() -> str:
            with urllib.request.urlopen(url, timeout=10) as response:
                assert response.headers["Content-Type"].startswith("text/plain")
                return str(response.read().decode())

        return Scrape(await asyncio.to_thread(get))

    async def probe(self, path: str) -> tuple[int, Any]:
        """A probe of the worker (`/healthz`, `/readyz`): its HTTP status and JSON body."""
        url = f"http://127.0.0.1:{self.web_port}{path}"

        def get() -> tuple[int, Any]:
            try:
                with urllib.request.urlopen(url, timeout=10) as response:
                    return response.status, orjson.loads(response.read())
            except urllib.error.HTTPError as refused:
                return refused.code, orjson.loads(refused.read())

        return await asyncio.to_thread(get)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class Scrape:
    """Samples of one /metrics scrape."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples = [
            (sample.name, sample.labels, sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        ]

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples named `name` whose labels include `labels` (0 if none)."""
        return sum(
            v
            for n, have, v in self.samples
            if n == name and all(have.get(k) == want for k, want in labels.items())
        )

    def has(self, name: str) -> bool:
        return any(n == name for n, _, _ in self.samples)


async def ready_within(worker: WorkerProcess, timeout_s: float) -> Any:
    """`/readyz` once it answers 200 (its last answer in the failure otherwise)."""
    deadline = time.monotonic() + timeout_s
    code, body = 0, None
    while time.monotonic() < deadline:
        assert worker.alive(), worker.log_tail()
        try:
            code, body = await worker.probe("/readyz")
        except OSError:  # not listening yet: still starting
            code, body = 0, None
        if code == 200:
            return body
        await asyncio.sleep(0.3)
    raise AssertionError(f"not ready within {timeout_s}s: {code} {body}")


async def committed(settings: Settings) -> int:
    """Records committed by the worker's group, over all task partitions."""
    consumer = clients.consumer(settings, purpose="committed", group_id=settings.app_id,
                                enable_auto_commit=False)  # fmt: skip
    await consumer.start()
    try:
        parts = consumer.partitions_for_topic(settings.topics.tasks) or set()
        total = 0
        for p in parts:
            total += await consumer.committed(TopicPartition(settings.topics.tasks, p)) or 0
        return total
    finally:
        await consumer.stop()


def run_cli(
    settings: Settings, *args: str, timeout_s: float = 120
) -> subprocess.CompletedProcess[str]:
    """`llm-streams ARGS…` with the settings in its environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_STREAMS_")}
    env.update(settings_env(settings))
    return subprocess.run([sys.executable, "-m", "streams.cli", *args], env=env,
                          capture_output=True, text=True, timeout=timeout_s)  # fmt: skip


def assert_each_task_answered_once(got: Collected, task_ids: set[str]) -> dict[str, str]:
    """No task lost; repeats (at-least-once) only under the same result key, same output.
    Returns each task's result key."""
    keys: dict[str, set[str]] = defaultdict(set)
    outputs: dict[str, set[bytes]] = defaultdict(set)
    for r in got.results:
        keys[r["task_id"]].add(r["result_key"])
        outputs[r["task_id"]].add(orjson.dumps(r["output"], option=orjson.OPT_SORT_KEYS))
    missing = task_ids - set(keys)
    assert not missing, f"{len(missing)} tasks lost"
    assert all(len(k) == 1 for k in keys.values()), "a task answered under two result keys"
    assert all(len(o) == 1 for o in outputs.values()), "a task answered with two outputs"
    return {task_id: next(iter(k)) for task_id, k in keys.items()}


def _runs(positions: list[tuple[int, int]]) -> str:
    """(partition, offset) pairs said as runs: "p7 0-41, p3 12"."""
    runs: list[list[int]] = []  # [partition, first, last]
    for partition, offset in sorted(positions):
        if runs and runs[-1][0] == partition and runs[-1][2] == offset - 1:
            runs[-1][2] = offset
        else:
            runs.append([partition, offset, offset])
    said = [f"p{p} {a}" if a == b else f"p{p} {a}-{b}" for p, a, b in runs[:8]]
    return ", ".join(said) + (" ..." if len(runs) > 8 else "")


def assert_one_outcome_each(
    got: Collected, task_ids: set[str], where: Mapping[str, tuple[int, int]] | None = None
) -> None:
    """Each task ends as one outcome, its result or its dead letter: never both, never
    none. Repeats (at-least-once) only under the same result key with the same output,
    or as the same error. `where`: each task's (partition, offset) in the tasks topic, to
    say where lost tasks were."""
    answered = {r["task_id"] for r in got.results}
    dead: dict[str, set[str]] = defaultdict(set)
    for d in got.dead_letters:
        dead[d["task_id"]].add(f"{d['error']['category']}:{d['error']['code']}")
    both = answered & set(dead)
    assert not both, f"{len(both)} tasks have a result and a dead letter: {sorted(both)[:5]}"
    missing = task_ids - answered - set(dead)
    assert not missing, f"{len(missing)} tasks lost: {sorted(missing)[:5]}" + (
        f" (at {_runs([where[t] for t in missing if t in where])})" if where else ""
    )
    assert all(len(e) == 1 for e in dead.values()), "a task dead-lettered with two errors"
    answered_ids = task_ids & answered
    assert_each_task_answered_once(
        Collected(results=[r for r in got.results if r["task_id"] in answered_ids]),
        answered_ids,
    )


async def topic_takes(settings: Settings, topic: str, max_bytes: int) -> None:
    """Make `topic` (made now if missing) take records up to `max_bytes`."""
    await ensure_topics(settings, [topic])
    admin = clients.admin(settings)
    await admin.start()
    try:
        config = {"max.message.bytes": str(max_bytes)}
        await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, topic, config)])
    finally:
        await admin.close()


async def produce(
    settings: Settings, records: list[tuple[bytes | None, bytes | None]]
) -> list[tuple[int, int]]:
    """Send raw records to the tasks topic; return (partition, offset) of each."""
    await ensure_topics(settings)  # co-partitioned, before the broker auto-creates them
    producer = clients.producer(settings, acks="all", linger_ms=5)  # over any protocol
    await producer.start()
    try:
        futures = [await producer.send(settings.topics.tasks, key=k, value=v) for k, v in records]
        metas = await asyncio.gather(*futures)
        return [(m.partition, m.offset) for m in metas]
    finally:
        await producer.stop()


@dataclass
class Collected:
    results: list[dict[str, Any]] = field(default_factory=list)
    dead_letters: list[dict[str, Any]] = field(default_factory=list)
    result_keys: list[str] = field(default_factory=list)

    def sources(self) -> set[tuple[int, int]]:
        return {
            (r["source"]["partition"], r["source"]["offset"])
            for r in self.results + self.dead_letters
        }


async def collect(
    settings: Settings,
    expected: set[tuple[int, int]],
    *,
    timeout_s: float,
    worker: WorkerProcess | None = None,
    settle_s: float = 1.0,
    until: Callable[[Collected], bool] | None = None,
    read_committed: bool = False,
) -> Collected:
    """Read results and dead letters until every expected source offset is answered
    (and `until`, when given, holds), then `settle_s` more to catch duplicates."""
    consumer = clients.consumer(
        settings,
        settings.topics.results,
        settings.topics.dead_letters,
        purpose="collector",
        group_id=f"collector-{uuid.uuid4().hex[:8]}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        isolation_level="read_committed" if read_committed else "read_uncommitted",
    )
    await consumer.start()
    got = Collected()
    deadline = time.monotonic() + timeout_s
    done_at: float | None = None
    try:
        while time.monotonic() < deadline:
            if worker is not None and not worker.alive():
                raise AssertionError(f"worker died:\n{worker.log_tail()}")
            batch = await consumer.getmany(timeout_ms=300)
            for records in batch.values():
                for rec in records:
                    data = json_object(rec.value)
                    if data is None:  # not ours (a test may write garbage there)
                        continue
                    if rec.topic == settings.topics.results:
                        got.results.append(data)
                        got.result_keys.append(rec.key.decode())
                    else:
                        got.dead_letters.append(data)
            if expected <= got.sources() and (until is None or until(got)):
                done_at = done_at or time.monotonic()
                if time.monotonic() - done_at >= settle_s:
                    return got
        return got
    finally:
        await consumer.stop()


async def register_schema(
    url: str, subject: str, schema: dict[str, Any], kind: str = "AVRO"
) -> int:
    """Register `schema` under `subject` as a producer of the user's would; its id."""
    body = {"schema": orjson.dumps(schema).decode(), "schemaType": kind}
    async with aiohttp.ClientSession() as session, session.post(
        f"{url}/subjects/{subject}/versions", json=body,
        headers={"Content-Type": "application/vnd.schemaregistry.v1+json"},
    ) as reply:  # fmt: skip
        assert reply.status == 200, await reply.text()
        return int((await reply.json())["id"])


def registry_framed(schema_id: int, schema: dict[str, Any] | None, record: Any) -> bytes:
    """`record` in the registry's wire format: 0, the schema id, then Avro (`schema`) or
    JSON (None: a JSON Schema subject)."""
    if schema is None:  # JSON Schema: the JSON itself after the header
        body = orjson.dumps(record)
    else:
        out = io.BytesIO()
        fastavro.schemaless_writer(out, fastavro.parse_schema(schema), record)
        body = out.getvalue()
    return b"\x00" + schema_id.to_bytes(4, "big") + body
