"""Pipeline overhead: tasks/s through one llm-streams worker vs a bare Faust pass-through.

Same broker (Apache Kafka 4.1.1 from jars, KRaft), same record sizes, one run.
The LLM simulator answers at 0 ms with no limits, in its own process. Each side
gets N records pre-loaded into a 4-partition topic, then one worker starts;
throughput = N / (time of last output - time of first output) as seen by a
consumer of the output topic(s). Prints both, their ratio and each worker's
peak RSS (VmHWM).

    python bench/pipeline_overhead.py [--tasks 10000]
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
from aiokafka.admin import AIOKafkaAdminClient

from streams.dev.brokers.apache import ApacheKafka
from streams.dev.brokers.common import free_port, wait_for_port
from streams.kafka.topics import ensure_topics
from streams.settings import Settings, load_settings, settings_env

HERE = Path(__file__).resolve().parent
TEXTS = [
    "Arrived two days late and the box was crushed, but the blender itself works great.",
    "快递太慢了，包装也破了，很失望。",
    "Love it! Excellent quality, would buy again.",
    "The instructions are confusing and the app keeps crashing during setup.",
]


def task_record(i: int) -> tuple[bytes, bytes]:
    task = {
        "task_id": f"b-{i:07d}",
        "pipeline": "comment-analysis",
        "input": {"text": f"{TEXTS[i % len(TEXTS)]} (#{i})", "product": "blender"},
    }
    return task["task_id"].encode(), orjson.dumps(task)


async def preload(bootstrap: str, topic: str, n: int, first: int = 0) -> int:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, acks=1)
    await producer.start()
    size = 0
    try:
        futures = []
        for i in range(first, first + n):
            key, value = task_record(i)
            size += len(value)
            futures.append(await producer.send(topic, key=key, value=value))
        await asyncio.gather(*futures)
    finally:
        await producer.stop()
    return size // n


async def warm_up(kafka: ApacheKafka, n: int) -> None:
    """Push n records through a fresh broker first: its JIT warm-up would bill the first phase."""
    topic = f"warm-{uuid.uuid4().hex[:6]}"
    await create_topic(kafka.bootstrap, topic)
    await preload(kafka.bootstrap, topic, n)
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=kafka.bootstrap, auto_offset_reset="earliest"
    )
    await consumer.start()
    seen = 0
    try:
        while seen < n:
            batch = await consumer.getmany(timeout_ms=500)
            seen += sum(len(v) for v in batch.values())
    finally:
        await consumer.stop()


async def group_stable(settings: Settings, members: int, timeout_s: float = 120) -> None:
    """Wait until the workers' consumer group is Stable with `members` members."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap_servers)
    await admin.start()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            try:
                (response,) = await admin.describe_consumer_groups([settings.app_id])
                # Raw DescribeGroups: (error, group_id, state, protocol_type, protocol, members)
                group = response.groups[0]
                if group[2] == "Stable" and len(group[5]) == members:
                    return
            except Exception:  # coordinator not there yet
                pass
            await asyncio.sleep(0.5)
        raise RuntimeError(f"group {settings.app_id} not stable with {members} members")
    finally:
        await admin.close()


async def create_topic(bootstrap: str, name: str, partitions: int = 4) -> None:
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, partitions, 1)])
    finally:
        await admin.close()


async def measure(
    bootstrap: str, topics: list[str], n: int, proc: subprocess.Popen[bytes]
) -> tuple[float, int, float]:
    """Records/s between the first and the n-th output; the worker's peak RSS in kB and
    its CPU milliseconds per record over the same span (less sensitive to a noisy host)."""
    consumer = AIOKafkaConsumer(
        *topics,
        bootstrap_servers=bootstrap,
        group_id=f"bench-{uuid.uuid4().hex[:6]}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    seen = seen_first = 0
    first = last = cpu_first = cpu_last = 0.0
    deadline = time.monotonic() + 600
    try:
        while seen < n and time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"worker exited with {proc.returncode}")
            batch = await consumer.getmany(timeout_ms=200, max_records=5000)
            got = sum(len(v) for v in batch.values())
            if got:
                now = time.monotonic()
                if not first:
                    first, cpu_first, seen_first = now, cpu_seconds(proc.pid), got
                last, cpu_last = now, cpu_seconds(proc.pid)
                seen += got
    finally:
        await consumer.stop()
    if seen < n:
        raise RuntimeError(f"only {seen}/{n} outputs")
    span = max(last - first, 1e-9)
    counted = max(seen - seen_first, 1)
    return counted / span, peak_rss_kb(proc.pid), (cpu_last - cpu_first) * 1000 / counted


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def spawn_worker(
    settings: Settings, log_path: Path, web_port: int | None = None
) -> subprocess.Popen[bytes]:
    """`llm-streams worker` with exactly `settings` (none of this shell's) and its web
    server on `web_port` (default: a free one), its output in `log_path`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_STREAMS_")}
    env.update(settings_env(settings))
    env["LLM_STREAMS_WEB_PORT"] = str(web_port or free_port())
    with open(log_path, "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "streams.cli", "worker"], env=env,
                                stdout=log, stderr=subprocess.STDOUT)  # fmt: skip


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def run_passthrough(
    kafka: ApacheKafka, n: int, logdir: Path
) -> tuple[float, int, float, int]:
    suffix = uuid.uuid4().hex[:6]
    source, sink = f"pt-in-{suffix}", f"pt-out-{suffix}"
    await create_topic(kafka.bootstrap, source)
    await create_topic(kafka.bootstrap, sink)
    size = await preload(kafka.bootstrap, source, n)
    env = {
        **os.environ,
        "BENCH_BROKER": kafka.url,
        "BENCH_SOURCE": source,
        "BENCH_SINK": sink,
        "BENCH_APP_ID": f"pt-{suffix}",
        "BENCH_WEB_PORT": str(free_port()),
    }
    with open(logdir / "passthrough.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "passthrough_app.py")],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=logdir,
        )  # fmt: skip
    try:
        rate, rss, cpu = await measure(kafka.bootstrap, [sink], n, proc)
    finally:
        stop(proc)
    return rate, rss, cpu, size


async def run_pipeline(
    kafka: ApacheKafka, n: int, logdir: Path, concurrency: int
) -> tuple[float, int, float, dict[str, object]]:
    sim_port = free_port()
    sim = subprocess.Popen(
        [sys.executable, "-m", "streams.cli", "simulate-llm", "--port", str(sim_port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    wait_for_port("127.0.0.1", sim_port, 30)
    suffix = uuid.uuid4().hex[:6]
    settings = load_settings(
        app_id=f"bench-{suffix}",
        kafka={"broker_url": kafka.url, "partitions": 4},
        topics={
            name: f"{name}-{suffix}"
            for name in ("tasks", "replay", "results", "dead_letters", "review")
        },
        llm={"base_url": f"http://127.0.0.1:{sim_port}/v1", "api_key": "k", "model": "sim-1"},
        batch={"size": 500, "window_s": 0.05, "concurrency": concurrency},
        data_dir=logdir / "worker",
        log_level="warning",
    )
    await ensure_topics(settings)
    await preload(kafka.bootstrap, settings.topics.tasks, n)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_STREAMS_")}
    env.update(settings_env(settings))
    env["LLM_STREAMS_WEB_PORT"] = str(free_port())
    try:
        with open(logdir / "pipeline.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "streams.cli", "worker"],
                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=logdir,
            )  # fmt: skip
        try:
            rate, rss, cpu = await measure(
                kafka.bootstrap, [settings.topics.results, settings.topics.dead_letters], n, proc
            )
        finally:
            stop(proc)
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{sim_port}/sim/stats") as r:
            stats = orjson.loads(r.read())
    finally:
        stop(sim)
    return rate, rss, cpu, stats


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    logdir = Path(tempfile.mkdtemp(prefix="llm-streams-bench-"))
    with ApacheKafka(heap_mb=1024) as kafka:
        await warm_up(kafka, args.tasks)
        pt_rate, pt_rss, pt_cpu, size = await run_passthrough(kafka, args.tasks, logdir)
        pl_rate, pl_rss, pl_cpu, stats = await run_pipeline(
            kafka, args.tasks, logdir, args.concurrency
        )
    print(
        f"records: {args.tasks} tasks of ~{size} bytes, 4 partitions, Apache Kafka 4.1.1 (KRaft), one worker"
    )
    print(
        f"bare Faust pass-through : {pt_rate:8.0f} records/s   peak RSS {pt_rss / 1024:6.0f} MB"
        f"   worker CPU {pt_cpu:.2f} ms/record"
    )
    print(
        f"llm-streams pipeline    : {pl_rate:8.0f} tasks/s     peak RSS {pl_rss / 1024:6.0f} MB"
        f"   worker CPU {pl_cpu:.2f} ms/task"
    )
    print(f"ratio pipeline / pass-through: {pl_rate / pt_rate:.2f}")
    print(f"simulator: {stats['by_status']}, duplicate successes {stats['duplicate_successes']}")
    print(f"logs: {logdir}")


if __name__ == "__main__":
    asyncio.run(main())
