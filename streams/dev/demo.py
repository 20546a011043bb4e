"""`llm-streams demo`: the whole job on embedded defaults, with live results.

Tansu (embedded broker) + the LLM simulator, unless OPENAI_API_KEY or
OPENAI_BASE_URL points at a real endpoint + one worker process + the bundled
sample comments; prints results as they land, a summary, and where to look next. With
`keep`, broker, simulator and worker stay up until Ctrl-C, for `status`, `tail` and the
dashboard; its temporary folder goes at the end (kept, and named, when something failed).
"""

from __future__ import annotations

import asyncio
import importlib.resources
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from streams.dev.brokers.common import free_port
from streams.dev.brokers.tansu import TansuBroker
from streams.dev.simulator import SimConfig, SimulatorServer, percentile
from streams.kafka import clients
from streams.kafka.publisher import TaskPublisher
from streams.kafka.security import preflight
from streams.kafka.topics import ensure_topics
from streams.ops.render import describe
from streams.settings import Settings, load_settings

# Records that break the contract, to show where bad input goes.
POISON: list[tuple[bytes | None, bytes]] = [
    (b"demo-poison-1", b"this is not json {"),
    (b"demo-poison-2", b'{"task_id": "demo-poison-2", "pipeline": "comment-analysis"}'),
    (
        b"demo-poison-3",
        b'{"task_id": "demo-poison-3", "pipeline": "no-such-pipeline", "input": {"text": "hi"}}',
    ),
]


def sample_comments() -> list[dict[str, Any]]:
    data = importlib.resources.files("streams") / "samples" / "comments.jsonl"
    return [orjson.loads(line) for line in data.read_bytes().splitlines() if line.strip()]


def _spawn_worker(env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "wb") as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", "streams.cli", "worker"],
            env=env, stdout=log_file, stderr=subprocess.STDOUT,
        )  # fmt: skip


def _environment(broker: TansuBroker | None, workdir: Path, demo_id: str) -> dict[str, str]:
    """The worker's environment: the embedded broker, or the Kafka the settings name
    (with topics of the demo's own, never someone's real ones)."""
    env = {
        **os.environ,
        "LLM_STREAMS_STORE": "memory://",
        "LLM_STREAMS_PROCESSING_GUARANTEE": "at_least_once",
        "LLM_STREAMS_DATA_DIR": str(workdir / "worker"),
        "LLM_STREAMS_WEB_PORT": str(free_port()),
        "LLM_STREAMS_APP_ID": demo_id,
    }
    if broker is not None:
        env.update({
            "LLM_STREAMS_KAFKA__BROKER_URL": broker.url,
            # Tansu holds each group join for session_timeout / 2.
            "LLM_STREAMS_KAFKA__SESSION_TIMEOUT_S": "6",
            "LLM_STREAMS_KAFKA__IDEMPOTENT_PRODUCER": "false",
            # Tansu answers a fetch at the end of its wait, not when a record comes: the
            # wait is what each record waits (bench/latency.py --broker tansu).
            "LLM_STREAMS_KAFKA__FETCH_MAX_WAIT_MS": "100",
        })  # fmt: skip
    else:
        for name in ("tasks", "replay", "results", "dead_letters", "review"):
            env[f"LLM_STREAMS_TOPICS__{name.upper()}"] = f"{demo_id}-{name}"
    return env


def run_demo(
    *, count: int, timeout_s: float, quiet: bool, external: bool = False, keep: bool = False
) -> int:
    try:
        return asyncio.run(_demo(count=count, timeout_s=timeout_s, quiet=quiet,
                                 external=external, keep=keep))  # fmt: skip
    except KeyboardInterrupt:  # Ctrl-C while kept up: everything was stopped on the way out
        return 0


def next_steps(env: dict[str, str], results_topic: str, keep: bool) -> list[str]:
    """What to type next, in another shell, against this demo's worker and broker."""
    port = env["LLM_STREAMS_WEB_PORT"]
    shared = {k: v for k, v in env.items()
              if k.startswith(("LLM_STREAMS_KAFKA__", "LLM_STREAMS_TOPICS__"))}  # fmt: skip
    exports = " ".join(f"{k}={v}" for k, v in sorted(shared.items()))
    if not keep:
        return [
            "run it again with --keep to keep broker, LLM and worker up and look around "
            "(dashboard, status, tail); README.md: your own topic, your key"
        ]
    return [
        f"dashboard   http://127.0.0.1:{port}/status   (metrics /metrics)",
        "in another shell:",
        f"  export {exports}" if exports else "  (the settings of this shell name the broker)",
        f"  llm-streams status --url http://127.0.0.1:{port}/status.json",
        f"  llm-streams tail {results_topic}",
        "  llm-streams status demo-0001",
        """  echo '{"text": "Arrived broken, nobody answers."}' | llm-streams publish -""",
        "Ctrl-C stops broker, LLM and worker",
    ]


async def _demo(*, count: int, timeout_s: float, quiet: bool, external: bool, keep: bool) -> int:
    console = Console()
    workdir = Path(tempfile.mkdtemp(prefix="llm-streams-demo-"))
    status = 1
    real_llm = bool(os.environ.get("OPENAI_API_KEY") or os.environ.get("OPENAI_BASE_URL"))
    broker = None if external else TansuBroker(log_file=workdir / "tansu.log").start()
    sim: SimulatorServer | None = None
    worker: subprocess.Popen[bytes] | None = None
    started = time.monotonic()
    demo_id = f"llm-streams-demo-{uuid.uuid4().hex[:6]}"
    try:
        env = _environment(broker, workdir, demo_id)
        sim = await _llm(console, env, real_llm)
        os.environ.update({k: v for k, v in env.items() if k.startswith("LLM_STREAMS_")})
        settings = load_settings()
        if broker is not None:
            console.print(f"[bold]Broker:[/bold] embedded Tansu at {broker.bootstrap} "
                          "(memory only)")  # fmt: skip
        else:
            await preflight(settings)
            console.print(f"[bold]Broker:[/bold] {settings.bootstrap_servers} "
                          f"({settings.kafka.security.protocol}), topics {demo_id}-*")  # fmt: skip
        await ensure_topics(settings)

        log_path = workdir / "worker.log"
        worker = _spawn_worker(env, log_path)
        console.print(f"[bold]Worker:[/bold] pid {worker.pid}, status "
                      f"http://127.0.0.1:{env['LLM_STREAMS_WEB_PORT']}/status, "
                      f"log {log_path}")  # fmt: skip

        expected, published = await _publish_samples(settings, count)
        console.print(
            f"published {published} sample comments and {len(POISON)} malformed records\n"
        )
        status = await _watch(
            console, settings, expected, worker, started, timeout_s, quiet, real_llm
        )
        console.print()
        for line in next_steps(env, settings.topics.results, keep and worker.poll() is None):
            console.print(line, highlight=False, markup=False)
        if keep and worker.poll() is None:
            await asyncio.to_thread(worker.wait)  # Ctrl-C cancels; the worker is stopped below
        return status
    finally:
        await _stop(worker, sim, broker)
        if status == 0:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            console.print(f"logs kept in {workdir}")


def _summary(
    done: dict[str, dict[str, Any]],
    expected: set[str],
    started: float,
    first_at: float | None,
    real_llm: bool,
) -> Table:
    """The demo's summary: what was published, answered and dead-lettered, latency,
    tokens, cost, sentiments, timings."""
    results = [d for d in done.values() if "output" in d]
    letters = [d for d in done.values() if "error" in d]
    latencies = [float(d["latency_ms"]) for d in results]
    table = Table(title="llm-streams demo summary", show_header=False)
    table.add_row("LLM", "real endpoint" if real_llm else "local simulator")
    table.add_row("records published", str(len(expected)))
    table.add_row("results", str(len(results)))
    by_cat = Counter(d["error"]["category"] for d in letters)
    table.add_row("dead letters", ", ".join(f"{c}: {n}" for c, n in by_cat.items()) or "0")
    table.add_row("missing", str(len(expected - done.keys())))
    p50, p95 = percentile(latencies, 0.5), percentile(latencies, 0.95)
    table.add_row("latency p50 / p95", f"{p50:.0f} ms / {p95:.0f} ms")
    table.add_row(
        "tokens prompt / completion",
        f"{sum(d['usage']['prompt_tokens'] for d in results)} / "
        f"{sum(d['usage']['completion_tokens'] for d in results)}",
    )
    table.add_row("cost (price table)", f"${sum(d['cost_usd'] for d in results):.4f}")
    sentiments = Counter(d["output"].get("sentiment") for d in results)
    table.add_row("sentiment", ", ".join(f"{k}: {v}" for k, v in sentiments.most_common()))
    if first_at is not None:
        table.add_row("first result after", f"{first_at - started:.1f} s")
    table.add_row("wall time", f"{time.monotonic() - started:.1f} s")
    return table


async def _llm(console: Console, env: dict[str, str], real_llm: bool) -> SimulatorServer | None:
    """The LLM the demo's worker calls: the user's endpoint (OPENAI_* set), or the local
    simulator, started and set in `env`."""
    if real_llm:
        where = os.environ.get("OPENAI_BASE_URL") or "api.openai.com"
        console.print(f"[bold]LLM:[/bold] your endpoint {where} (OPENAI_* set)")
        return None
    sim = await SimulatorServer(SimConfig(latency_ms=250, latency_jitter_ms=150)).start()
    env["LLM_STREAMS_LLM__BASE_URL"] = sim.base_url
    env["LLM_STREAMS_LLM__API_KEY"] = "sim-key"
    env["LLM_STREAMS_LLM__MODEL"] = "sim-1"
    console.print(
        f"[bold]LLM:[/bold] local simulator at {sim.base_url} "
        "(set OPENAI_API_KEY / OPENAI_BASE_URL to use a real endpoint)"
    )
    return sim


async def _publish_samples(settings: Settings, count: int) -> tuple[set[str], int]:
    """The sample comments (the first `count`, 0: all) and the malformed records,
    published; the task ids (and keys) the demo waits for, and the comments' count."""
    comments = sample_comments()
    if count:
        comments = comments[:count]
    expected: set[str] = set()
    async with TaskPublisher(settings) as pub:
        for i, comment in enumerate(comments):
            task_id = f"demo-{i:04d}"
            expected.add(task_id)
            await pub.publish(
                {"task_id": task_id, "pipeline": "comment-analysis", "input": comment},
                wait=False,
            )
        for key, value in POISON:
            expected.add(key.decode() if key else "")
            await pub.publish_raw(key, value)
        await pub.flush()
    return expected, len(comments)


async def _stop(
    worker: subprocess.Popen[bytes] | None, sim: SimulatorServer | None, broker: TansuBroker | None
) -> None:
    if worker is not None and worker.poll() is None:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(15)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
    if sim is not None:
        await sim.stop()
    if broker is not None:
        broker.stop()


async def _watch(
    console: Console,
    settings: Any,
    expected: set[str],
    worker: subprocess.Popen[bytes],
    started: float,
    timeout_s: float,
    quiet: bool,
    real_llm: bool,
) -> int:
    consumer = clients.consumer(
        settings,
        settings.topics.results,
        settings.topics.dead_letters,
        purpose="demo-view",
        group_id=f"llm-streams-demo-view-{uuid.uuid4().hex[:6]}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    done: dict[str, dict[str, Any]] = {}
    first_at: float | None = None
    try:
        deadline = started + timeout_s
        while not expected <= done.keys() and time.monotonic() < deadline:
            if worker.poll() is not None:
                console.print(f"[red]worker exited with status {worker.returncode}[/red]")
                break
            batch = await consumer.getmany(timeout_ms=500)
            for records in batch.values():
                for rec in records:
                    data = orjson.loads(rec.value) if rec.value else {}
                    task_id = str(data.get("task_id"))
                    if task_id in done:
                        continue
                    done[task_id] = data
                    first_at = first_at or time.monotonic()
                    if not quiet:
                        console.print(describe(rec.topic, rec.key, rec.value), highlight=False)
    finally:
        await consumer.stop()
    table = _summary(done, expected, started, first_at, real_llm)
    console.print()
    console.print(table)
    return 0 if expected <= done.keys() else 1
