"""Task store recovery at a large history: restart and takeover time, peak memory, disk.

One run: Apache Kafka 4.1.1 (jars) with ONE task partition whose results topic holds
`--tasks` results (default 1,000,000, ~0.9 KB each) and whose task-state changelog holds
as many task states (~0.6 KB): the shapes the worker writes. The LLM simulator answers.
For each store, `memory://` (the old default) and `rocksdb://` (on disk, checkpointed):

* takeover: a worker with no local store starts and owns the partition;
* restart: the same worker stopped (SIGTERM) and started again on its own data dir;

and for each: the load time the worker logs for the partition, the time from the
process start until it answered a task waiting in the topic (Faust's start and the
group's rebalance included), the worker's peak RSS (VmHWM) and the local store's disk.
Then retention: the on-disk worker keeps only the newest half of the results and task
states (`results_max`, `tasks_max`); its figures while it expires the other half, and
after a restart.

Phase `failover` (on disk): two workers in one group, the partition's owner SIGKILLed
with a new task waiting; the time from the kill and from the partition's reassignment
to the survivor's answer, its load time and peak RSS: without a standby (the survivor
reads the whole partition) and with `store_standby_replicas=1` (it followed the
partition before the kill).

    python bench/store_recovery.py [--tasks 1000000] [--stores memory://,rocksdb://]
        [--phases takeover,restart,failover] [--no-retention]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rate_limit_utilisation import Sim

from streams.core.taskstate import Status, TaskState
from streams.dev.brokers.apache import ApacheKafka
from streams.dev.brokers.common import free_port
from streams.kafka.topics import ensure_topics, state_topic
from streams.settings import Settings, load_settings, settings_env
from streams.store.taskstore import store_topics

LOADED = re.compile(r"state of partition 0 loaded in ([0-9.]+)s")


def result_value(i: int) -> bytes:
    """A result record as the worker writes one (~0.9 KB)."""
    return orjson.dumps({
        "task_id": f"t-{i:08d}", "result_key": f"rk1-{i:016x}", "pipeline": "comment-analysis",
        "prompt_version": "v3", "model": "sim-1", "attempts": 1,
        "output": {"sentiment": "negative", "score": -0.6, "topics": ["durability", "zip"],
                   "summary": f"Customer {i} reports the zip broke after two days of use; "
                              "asks for a replacement and rates the product poorly.",
                   "language": "en", "pii_found": False},
        "usage": {"prompt_tokens": 182, "completion_tokens": 64, "cost_usd": 0.000412},
        "source": {"topic": "tasks", "partition": 0, "offset": i},
        "input_hash": f"{i:064x}", "trace_id": f"{i:032x}",
        "created_at": "2026-11-30T10:00:00.000000+00:00",
        "processed_at": "2026-11-30T10:00:01.250000+00:00",
        "review": [], "latency_ms": 812.4, "tier": "standard",
    })  # fmt: skip


def state_value(i: int) -> bytes:
    """A task state as the worker writes one after the result (~0.6 KB)."""
    state = TaskState(task_id=f"t-{i:08d}", status=Status.RECEIVED, updated_at="")
    return state.moved(
        Status.SUCCEEDED, attempts=1, input_hash=f"{i:064x}", pipeline="comment-analysis",
        prompt_version="v3", result_key=f"rk1-{i:016x}", result_topic="results",
        result_partition=0,
    ).dumps()  # fmt: skip


async def fill(settings: Settings, n: int) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap_servers, acks=1,
                                linger_ms=20, max_batch_size=512 * 1024)  # fmt: skip
    await producer.start()
    try:
        started = time.monotonic()
        for first in range(0, n, 20_000):
            sends = []
            for i in range(first, min(n, first + 20_000)):
                sends.append(await producer.send(settings.topics.results, partition=0,
                                                 key=f"rk1-{i:016x}".encode(),
                                                 value=result_value(i)))  # fmt: skip
                sends.append(await producer.send(state_topic(settings), partition=0,
                                                 key=f"t-{i:08d}".encode(), value=state_value(i)))  # fmt: skip
            await asyncio.gather(*sends)
        print(f"filled {n:,} results and task states in {time.monotonic() - started:.0f}s",
              flush=True)  # fmt: skip
    finally:
        await producer.stop()


async def probe(settings: Settings, n: int) -> tuple[bytes, int]:
    """A new task waiting in the tasks topic; (its task id, results end before it)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap_servers)
    await consumer.start()
    try:
        from aiokafka import TopicPartition

        tp = TopicPartition(settings.topics.results, 0)
        end = (await consumer.end_offsets([tp]))[tp]
    finally:
        await consumer.stop()
    task_id = f"probe-{n}-{uuid.uuid4().hex[:6]}"
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap_servers)
    await producer.start()
    try:
        task = {"task_id": task_id, "pipeline": "comment-analysis",
                "input": {"text": "Arrived late but works."}}  # fmt: skip
        await producer.send_and_wait(settings.topics.tasks, orjson.dumps(task),
                                     key=task_id.encode(), partition=0)  # fmt: skip
    finally:
        await producer.stop()
    return task_id.encode(), end


async def answered(settings: Settings, task_id: bytes, start: int, timeout_s: float) -> bool:
    from aiokafka import TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap_servers,
                                enable_auto_commit=False)  # fmt: skip
    tp = TopicPartition(settings.topics.results, 0)
    consumer.assign([tp])
    await consumer.start()
    consumer.seek(tp, start)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            for records in (await consumer.getmany(tp, timeout_ms=200)).values():
                if any(orjson.loads(r.value).get("task_id") == task_id.decode()
                       for r in records if r.value):  # fmt: skip
                    return True
        return False
    finally:
        await consumer.stop()


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def disk_mb(path: Path) -> float:
    if not path.exists():
        return 0.0
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / (1 << 20)


def expired(port: int) -> float:
    """Entries the worker expired so far (results and task states)."""
    return metric(port, "llm_streams_store_expired_total")


def spawn(settings: Settings, data: Path, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    """A worker process on `data`; (it, its web port)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_STREAMS_")}
    env.update(settings_env(settings))
    port = free_port()
    env["LLM_STREAMS_WEB_PORT"] = str(port)
    env["LLM_STREAMS_DATA_DIR"] = str(data)
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "streams.cli", "worker"], env=env,
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    return proc, port


def readyz(port: int) -> dict[str, Any]:
    """The worker's /readyz (503 while not ready: its body all the same); {} if away."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
            return dict(orjson.loads(r.read()))
    except urllib.error.HTTPError as exc:
        return dict(orjson.loads(exc.read()))
    except OSError:
        return {}


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))  # fmt: skip


async def run_worker(
    settings: Settings, data: Path, log: Path, n: int, expire: int = 0
) -> dict[str, float]:
    """A worker on `data` until it answered a waiting task (and, with `expire`, until it
    expired that many entries); its figures."""
    task_id, start = await probe(settings, n)
    began = time.monotonic()
    proc, port = spawn(settings, data, log)
    try:
        if not await answered(settings, task_id, start, timeout_s=900):
            raise SystemExit(f"no answer within 900s; see {log}")
        to_answer = time.monotonic() - began
        while expire and expired(port) < expire:
            if time.monotonic() - began > 3600 or proc.poll() is not None:
                raise SystemExit(f"expired {expired(port):.0f} of {expire}; see {log}")
            await asyncio.sleep(2)
        rss = peak_rss_mb(proc.pid)
    finally:
        proc.terminate()
        proc.wait(120)
    loads = LOADED.findall(log.read_text())
    return {"answer_s": to_answer, "load_s": float(loads[-1]) if loads else float("nan"),
            "rss_mb": rss, "disk_mb": disk_mb(data / "store")}  # fmt: skip


async def partition_records(settings: Settings) -> int:
    """Records in partition 0 of the task store's topics (their end offsets, summed)."""
    from aiokafka import TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap_servers)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, 0) for topic in store_topics(settings).values()]
        return sum((await consumer.end_offsets(tps)).values())
    finally:
        await consumer.stop()


async def until(check: Callable[[], bool], what: str, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


async def failover(base: Settings, folder: Path, standby: int, n: int) -> dict[str, float]:
    """Two on-disk workers; the partition's owner SIGKILLed with a task waiting: the
    survivor's figures (`standby` replicas)."""
    kafka = base.kafka.model_copy(update={"session_timeout_s": 6})
    settings = base.model_copy(update={"store": "rocksdb://", "kafka": kafka,
                                       "store_standby_replicas": standby})  # fmt: skip
    name = f"failover-{standby}"
    task_id, start = await probe(settings, n)
    first = spawn(settings, folder / f"{name}-a", folder / f"{name}-a.log")
    procs = [first]
    try:
        if not await answered(settings, task_id, start, timeout_s=900):
            raise SystemExit(f"the first worker did not answer; see {folder}/{name}-a.log")
        procs.append(spawn(settings, folder / f"{name}-b", folder / f"{name}-b.log"))
        ports = [port for _, port in procs]
        await until(lambda: all(readyz(p).get("joined") for p in ports)
                    and sum(len(readyz(p).get("partitions") or ()) for p in ports) == 1,
                    "both workers in the group")  # fmt: skip
        owner = next(i for i, p in enumerate(ports) if readyz(p).get("partitions"))
        (victim, _), (survivor, port) = procs[owner], procs[1 - owner]
        if standby:  # the survivor followed all of the partition so far
            held = await partition_records(settings)
            await until(lambda: metric(port, "llm_streams_store_standby_records_total") >= held,
                        "the standby to catch up")  # fmt: skip
        task_id, start = await probe(settings, n + 1)
        victim.kill()
        killed = time.monotonic()
        await until(lambda: 0 in (readyz(port).get("partitions") or ()), "the reassignment")
        assigned = time.monotonic()
        if not await answered(settings, task_id, start, timeout_s=900):
            raise SystemExit(f"the survivor did not answer; see {folder}")
        done = time.monotonic()
        rss = peak_rss_mb(survivor.pid)
        log = folder / f"{name}-{'ab'[1 - owner]}.log"
        loads = LOADED.findall(log.read_text())
        return {"kill_s": done - killed, "assigned_s": done - assigned,
                "load_s": float(loads[-1]) if loads else float("nan"), "rss_mb": rss}  # fmt: skip
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(120)


def show(store: str, phase: str, figures: dict[str, float]) -> None:
    print(f"{store:12} {phase:9} load {figures['load_s']:6.2f}s  answered after "
          f"{figures['answer_s']:6.2f}s  peak RSS {figures['rss_mb']:7.0f} MB  "
          f"disk {figures['disk_mb']:7.0f} MB", flush=True)  # fmt: skip


async def main(tasks: int, stores: list[str], phases: list[str], retention: bool) -> None:
    folder = Path(tempfile.mkdtemp(prefix="store-recovery-"))
    kafka = ApacheKafka().start()
    sim = Sim(rpm=0, tpm=0, latency_ms=50, jitter_ms=10, error_rate=0.0)
    try:
        suffix = uuid.uuid4().hex[:6]
        base = load_settings(
            app_id=f"recovery-{suffix}",
            kafka={"broker_url": f"kafka://{kafka.bootstrap}", "partitions": 1},
            topics={name: f"{name}-{suffix}" for name in
                    ("tasks", "replay", "results", "dead_letters", "review")},
            llm={"base_url": f"{sim.base}/v1", "api_key": sim.KEY, "model": "sim-1"},
        )  # fmt: skip
        await ensure_topics(base)
        await fill(base, tasks)
        by: dict[tuple[str, str], dict[str, float]] = {}
        if "failover" in phases:
            over = {s: await failover(base, folder, s, 1000 + s) for s in (0, 1)}
            for s, f in over.items():
                print(f"failover, {s} standby: answered {f['kill_s']:.2f}s after the kill, "
                      f"{f['assigned_s']:.2f}s after the reassignment (load "
                      f"{f['load_s']:.2f}s), survivor's peak RSS {f['rss_mb']:.0f} MB",
                      flush=True)  # fmt: skip
            print(
                f"  reassignment to answer, standby vs none: {over[1]['assigned_s']:.2f}s vs "
                f"{over[0]['assigned_s']:.2f}s "
                f"({over[0]['assigned_s'] / max(over[1]['assigned_s'], 1e-3):.0f}x faster)"
            )
            phases = [p for p in phases if p != "failover"]
        for store in stores:
            # One app (its group and changelogs): the workers run one after the other.
            settings = base.model_copy(update={"store": store})
            for phase in phases:
                by[(store, phase)] = await run_worker(
                    settings, folder / store[:3], folder / f"{store[:3]}-{phase}.log", len(by)
                )
                show(store, phase, by[(store, phase)])
        if not retention or set(stores) != {"memory://", "rocksdb://"} or "restart" not in phases:
            return
        # Retention: the on-disk worker keeps the newest half of results and task states.
        half = tasks // 2
        limits = {"results_max": half, "tasks_max": half, "check_s": 2.0}
        kept = base.model_copy(update={
            "store": "rocksdb://",
            "retention": base.retention.model_copy(update=limits)})  # fmt: skip
        by[("rocksdb://", "expiring")] = await run_worker(
            kept, folder / "roc", folder / "roc-expiring.log", len(by), expire=2 * half
        )
        show("rocksdb://", "expiring", by[("rocksdb://", "expiring")])
        by[("rocksdb://", "after")] = await run_worker(
            kept, folder / "roc", folder / "roc-after.log", len(by)
        )
        show("rocksdb://", "after", by[("rocksdb://", "after")])

        mem, rocks = by[("memory://", "restart")], by[("rocksdb://", "restart")]
        after = by[("rocksdb://", "after")]
        print(f"\n{tasks:,} tasks on one partition:")
        print(
            f"  restart load, rocksdb vs memory: {rocks['load_s']:.2f}s vs "
            f"{mem['load_s']:.2f}s ({mem['load_s'] / max(rocks['load_s'], 1e-3):.0f}x faster)"
        )
        print(
            f"  peak RSS at restart, rocksdb vs memory: {rocks['rss_mb']:.0f} MB vs "
            f"{mem['rss_mb']:.0f} MB ({rocks['rss_mb'] / mem['rss_mb']:.2f})"
        )
        print(
            f"  disk after half expired vs before: {after['disk_mb']:.0f} MB vs "
            f"{rocks['disk_mb']:.0f} MB ({after['disk_mb'] / rocks['disk_mb']:.2f})"
        )
    finally:
        sim.proc.terminate()
        kafka.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=1_000_000)
    parser.add_argument("--stores", default="memory://,rocksdb://")
    parser.add_argument("--phases", default="takeover,restart")
    parser.add_argument(
        "--no-retention",
        action="store_true",
        help="Skip the retention phases (they need both stores and the restart phase).",
    )
    args = parser.parse_args()
    asyncio.run(main(args.tasks, args.stores.split(","), args.phases.split(","),
                     not args.no_retention))  # fmt: skip
