"""Worker CPU per task in every regime of traffic: saturation, paced, rate-limited, idle.

One run, one broker (Apache Kafka 4.1.1 from jars), one LLM simulator process,
one llm-streams worker (the shipped comment pipeline; spans and redaction on)
that lives through all regimes in turn, on the same topics:

1. idle: no traffic, CPU per second;
2. saturation: N tasks pre-loaded, the simulator answering at once, no limits
   (a 5 s window while they drain);
3. paced 10/s and 50/s (or any rate N/s: pacedN): tasks published at that rate,
   answers in 300 +- 100 ms;
4. rate-limited: N tasks pre-loaded, the simulator enforcing 3,000 RPM (50/s)
   with 300 +- 100 ms answers, the limit not told to the worker;
5. packed: N tasks pre-loaded for comment-analysis with prompt packing (packs of
   up to 20 comments, as bench/packing.py), answered at once (a 5 s window).

Printed per regime: tasks answered in the measuring window, and the worker's CPU
(user + system, from /proc) per task over that window. `--profile DIR` also
records each window with py-spy (attached to the worker) and prints the top
entries by own time and by total time; `--strace` counts the worker's system
calls per task (strace slows the worker: its CPU figures are then not the
worker's own); `--floor` measures, right after the worker at each paced rate,
floors started beside it: three bare pass-throughs that write each record on (one
acked write) — a Faust agent (Faust's consumer thread), the same agent with its
consumer on the app's loop as the worker runs it, aiokafka alone on one event loop
— and the worker's stack doing a task's I/O and nothing else (Faust in-loop, one
chat completion to the same simulator, then two acked writes: result, state). The
floors under the worker's cost, minutes apart from it at most.

    python bench/cpu_per_task.py [--tasks 10000] [--seconds 30] [--regimes idle,paced2,paced10]
                                 [--profile DIR [--native]] [--strace] [--floor]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_overhead import (
    HERE,
    cpu_seconds,
    create_topic,
    preload,
    stop,
    task_record,
    warm_up,
)
from rate_limit_utilisation import Sim

from streams.dev.brokers.apache import ApacheKafka
from streams.dev.brokers.common import free_port
from streams.kafka.topics import ensure_topics
from streams.settings import Settings, load_settings, settings_env


class Outcomes:
    """Counts results and dead letters as they arrive."""

    def __init__(self) -> None:
        self.count = 0

    async def read(self, bootstrap: str, topics: list[str], stop_event: asyncio.Event) -> None:
        consumer = AIOKafkaConsumer(
            *topics, bootstrap_servers=bootstrap, group_id=f"cpu-{uuid.uuid4().hex[:6]}",
            auto_offset_reset="earliest", enable_auto_commit=False,
        )  # fmt: skip
        await consumer.start()
        try:
            while not stop_event.is_set():
                batch = await consumer.getmany(timeout_ms=100, max_records=5000)
                self.count += sum(len(v) for v in batch.values())
        finally:
            await consumer.stop()

    async def until(self, n: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.count < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {self.count}/{n} outcomes")
            await asyncio.sleep(0.05)


class Profiler:
    """py-spy attached to the worker for one measuring window (raw collapsed stacks)."""

    def __init__(self, out: Path | None, pid: int, native: bool = False) -> None:
        self.out, self.pid, self.native = out, pid, native
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, name: str, seconds: float) -> None:
        if self.out is None:
            return
        self.file = self.out / f"{re.sub(r'[^a-z0-9]+', '-', name.lower()).strip('-')}.txt"
        # The venv's py-spy when the bench runs as .venv/bin/python without activating it.
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        self.proc = subprocess.Popen(
            [spy, "record", "-p", str(self.pid), "-d", str(int(seconds)), "-r", "200",
             "-f", "raw", "-o", str(self.file),
             # --native needs the process paused while sampled: the CPU figures then
             # include py-spy's pauses, the profile shows what runs inside uvloop.
             *(["--native"] if self.native else ["--nonblocking"])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def finish(self) -> tuple[Counter[str], Counter[str], int] | None:
        if self.proc is None:
            return None
        self.proc.wait(60)
        self.proc = None
        own: Counter[str] = Counter()
        total: Counter[str] = Counter()
        samples = 0
        for line in self.file.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            n = int(count)
            frames = [f for f in stack.split(";") if f]
            # Below the event loop: what a callback or task runs. The frames above it
            # (the CLI, the worker's start) are in every sample of the main thread.
            loop = [i for i, f in enumerate(frames) if f.split(" (")[0] in _LOOP_FRAMES]
            if loop:
                frames = frames[loop[-1] + 1 :]
            samples += n
            if not frames:  # inside uvloop's C code (I/O, scheduling): no Python frame
                own["(uvloop: I/O and scheduling, in C)"] += n
                continue
            own[_short(frames[-1])] += n
            for frame in {_short(f) for f in frames}:
                total[frame] += n
        return own, total, samples


_LOOP_FRAMES = {"Worker.execute_from_commandline", "BaseEventLoop.run_forever",
                "BaseEventLoop._run_once"}  # fmt: skip


def _short(frame: str) -> str:
    """`func (path/to/module.py:line)` -> `func (module.py)`."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    parts = Path(path).parts
    tail = "/".join(parts[parts.index("streams") :]) if "streams" in parts else Path(path).name
    return f"{name} ({tail})"


def thread_cpu(pid: int) -> dict[str, tuple[float, float]]:
    """CPU seconds so far per thread, (all, in the kernel): "main" (the event loop) and
    the others by id (Python does not name its threads for the OS)."""
    out: dict[str, tuple[float, float]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            rest = (task / "stat").read_text().rpartition(")")[2]
        except FileNotFoundError:  # the thread ended
            continue
        fields = rest.split()
        name = "main" if int(task.name) == pid else f"thread {task.name}"
        out[name] = ((int(fields[11]) + int(fields[12])) / tick, int(fields[12]) / tick)
    return out


class Syscalls:
    """`strace -c -f` attached to the worker for one measuring window: system calls
    (every wake-up of a thread is one) counted per kind."""

    def __init__(self, on: bool, pid: int) -> None:
        self.on, self.pid = on, pid
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        if self.on:
            self.proc = subprocess.Popen(["strace", "-c", "-f", "-p", str(self.pid)],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                         text=True)  # fmt: skip

    def finish(self) -> Counter[str] | None:
        if self.proc is None:
            return None
        self.proc.send_signal(signal.SIGINT)  # detaches and prints its summary
        _, summary = self.proc.communicate(timeout=30)
        self.proc = None
        calls: Counter[str] = Counter()
        for line in summary.splitlines():
            fields = line.split()
            # % time, seconds, usecs/call, calls, [errors], syscall
            if len(fields) >= 5 and fields[0][0].isdigit() and fields[-1] != "total":
                calls[fields[-1]] = int(fields[3])
        return calls


async def window(worker: subprocess.Popen[bytes], outcomes: Outcomes, profiler: Profiler,
                 syscalls: Syscalls, name: str,
                 seconds: float) -> tuple[int, float, dict[str, tuple[float, float]]]:  # fmt: skip
    """Tasks answered, worker CPU seconds and CPU seconds per thread over the next `seconds`."""
    profiler.start(name, seconds)
    syscalls.start()
    done, cpu, threads = outcomes.count, cpu_seconds(worker.pid), thread_cpu(worker.pid)
    await asyncio.sleep(seconds)
    after = thread_cpu(worker.pid)
    per_thread = {}
    for name, (spent, kernel) in after.items():
        spent_before, kernel_before = threads.get(name, (0.0, 0.0))
        per_thread[name] = (spent - spent_before, kernel - kernel_before)
    return outcomes.count - done, cpu_seconds(worker.pid) - cpu, per_thread


async def paced(producer: AIOKafkaProducer, topic: str, rate: float, seconds: float,
                first: int) -> int:  # fmt: skip
    """Publish tasks at `rate`/s for `seconds`; returns how many."""
    start, i = time.monotonic(), 0
    while (elapsed := time.monotonic() - start) < seconds:
        while i < int(elapsed * rate) + 1:
            key, value = task_record(first + i)
            await producer.send(topic, key=key, value=value)
            i += 1
        await asyncio.sleep(0.005)
    return i


T = TypeVar("T")


async def at_rate(producer: AIOKafkaProducer, topic: str, rate: int, seconds: float, sent: int,
                  outcomes: Outcomes, window: Callable[[], Awaitable[T]]) -> tuple[int, T]:  # fmt: skip
    """`window()` measured while tasks go to `topic` at `rate`/s (from 2 s in, so the
    window sees steady traffic), then every task answered; (tasks sent in all, what the
    window measured)."""
    pacer = asyncio.create_task(paced(producer, topic, rate, seconds + 4, sent))
    await asyncio.sleep(2.0)
    measured = await window()
    sent += await pacer
    await outcomes.until(sent, 120)
    return sent, measured


FLOORS = {  # name: the pass-through's script, and its environment
    "Faust pass-through": ("passthrough_app.py", {}),
    # Faust with its consumer on the app's loop, as the worker runs it (InLoopTransport)
    "Faust in-loop pass-through": ("passthrough_app.py", {"BENCH_IN_LOOP": "1"}),
    "aiokafka pass-through": ("passthrough_aiokafka.py", {}),
    # The worker's stack doing a task's I/O and nothing else: one chat completion, then
    # two acked writes (result, state), Faust's consumer on the app's loop
    "task's I/O on Faust in-loop": (
        "passthrough_app.py",
        {"BENCH_IN_LOOP": "1", "BENCH_TASK_IO": "1"},
    ),
}


class Floor:
    """A bare pass-through that writes each record on, awaiting the broker's ack: a
    Faust agent (bench/passthrough_app.py), or aiokafka alone on one loop
    (bench/passthrough_aiokafka.py) — what the framework costs per record before any
    of the worker's own work; or that Faust agent doing a task's I/O (BENCH_TASK_IO).
    Started beside the worker and measured right after the worker at each paced rate,
    so the host's drift between them stays small."""

    def __init__(self, kafka: ApacheKafka, script: str, extra: dict[str, str], logdir: Path,
                 llm_url: str) -> None:  # fmt: skip
        self.kafka, self.script, self.extra, self.logdir = kafka, script, extra, logdir
        self.llm_url = llm_url
        self.sent = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.producer: AIOKafkaProducer | None = None
        self.reader: asyncio.Task[None] | None = None
        self.stop_reading = asyncio.Event()

    async def start(self) -> None:
        kafka, suffix = self.kafka, uuid.uuid4().hex[:6]
        self.source, sink, state = f"pt-in-{suffix}", f"pt-out-{suffix}", f"pt-state-{suffix}"
        for topic in (self.source, sink, state):
            await create_topic(kafka.bootstrap, topic)
        env = {**os.environ, "BENCH_BROKER": kafka.url, "BENCH_BOOTSTRAP": kafka.bootstrap,
               "BENCH_SOURCE": self.source, "BENCH_SINK": sink, "BENCH_STATE": state,
               "BENCH_APP_ID": f"pt-{suffix}", "BENCH_WEB_PORT": str(free_port()),
               "BENCH_ACKED": "1", "BENCH_LLM_URL": self.llm_url, "BENCH_LLM_KEY": Sim.KEY,
               **self.extra}  # fmt: skip
        with open(self.logdir / f"{self.script}-{suffix}.log", "wb") as log:
            self.proc = subprocess.Popen([sys.executable, str(HERE / self.script)], env=env,
                                         stdout=log, stderr=subprocess.STDOUT,
                                         cwd=self.logdir)  # fmt: skip
        self.outcomes = Outcomes()
        self.reader = asyncio.create_task(
            self.outcomes.read(kafka.bootstrap, [sink], self.stop_reading)
        )
        self.producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap, linger_ms=5, acks=1)
        await self.producer.start()
        self.sent = await paced(self.producer, self.source, 20, 5, 0)  # joins the group
        await self.outcomes.until(self.sent, 120)

    async def measure(self, rate: int, seconds: float) -> tuple[int, float]:
        """Records written on and CPU seconds over `seconds` of traffic at `rate`/s."""
        assert self.proc is not None and self.producer is not None
        pid = self.proc.pid

        async def window() -> tuple[int, float]:
            done, cpu = self.outcomes.count, cpu_seconds(pid)
            await asyncio.sleep(seconds)
            return self.outcomes.count - done, cpu_seconds(pid) - cpu

        self.sent, row = await at_rate(self.producer, self.source, rate, seconds, self.sent,
                                       self.outcomes, window)  # fmt: skip
        return row

    async def close(self) -> None:
        await wind_down(self.producer, self.stop_reading, self.reader, self.proc)


async def wind_down(producer: AIOKafkaProducer | None, stop_reading: asyncio.Event,
                    reader: asyncio.Task[None] | None,
                    proc: subprocess.Popen[bytes] | None) -> None:  # fmt: skip
    """The traffic's producer, the outcomes' reader and the process under test, stopped:
    whatever of them started."""
    if producer is not None:
        await producer.stop()
    stop_reading.set()
    if reader is not None:
        await reader
    if proc is not None:
        stop(proc)


REGIMES = ("idle", "saturation", "paced10", "paced50", "limited", "packed")
PACED = re.compile(r"paced([1-9]\d*)")  # any steady rate: paced2, paced25, ...


async def traffic(
    kafka: ApacheKafka, settings: Settings
) -> tuple[Outcomes, asyncio.Event, asyncio.Task[None], AIOKafkaProducer]:
    """The measured worker's outcomes counted as they come (until the event is set), and
    a started producer for its tasks."""
    outcomes = Outcomes()
    stop_reading = asyncio.Event()
    reader = asyncio.create_task(outcomes.read(
        kafka.bootstrap, [settings.topics.results, settings.topics.dead_letters],
        stop_reading))  # fmt: skip
    producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap, linger_ms=5, acks=1)
    await producer.start()
    return outcomes, stop_reading, reader, producer


def worker_settings(kafka: ApacheKafka, sim: Sim, data_dir: Path, prefix: str,
                    **more: Any) -> Settings:  # fmt: skip
    """The measured worker's settings: topics of its own, the simulator, the log quiet,
    batches of 200 within 50 ms, 64 calls at once."""
    suffix = uuid.uuid4().hex[:6]
    return load_settings(
        app_id=f"{prefix}-{suffix}",
        kafka={"broker_url": kafka.url, "partitions": 4},
        topics={n: f"{n}-{suffix}" for n in ("tasks", "replay", "results", "dead_letters", "review")},
        llm={"base_url": f"{sim.base}/v1", "api_key": sim.KEY, "model": "sim-1"},
        batch={"size": 200, "window_s": 0.05, "concurrency": 64},
        data_dir=data_dir,
        log_level="warning",
        **more,
    )  # fmt: skip


def paced_rates(regimes: set[str]) -> list[int]:
    """The paced regimes' rates (tasks/s), slowest first."""
    return sorted(int(m[1]) for r in regimes if (m := PACED.fullmatch(r)))


PACKED = "comment-analysis-packed"


def pipelines_with_packing(folder: Path) -> Path:
    """The shipped pipelines, and comment-analysis again as PACKED with prompt packing."""
    folder.mkdir(parents=True)
    for path in (HERE.parent / "pipelines").glob("*.yaml"):
        shutil.copy(path, folder / path.name)
    spec = (HERE.parent / "pipelines" / "comment-analysis.yaml").read_text()
    packing = "packing: {slot: text, max_chars: 200, max_items: 20, linger_s: 0.05}\n"
    spec = spec.replace("name: comment-analysis\n", f"name: {PACKED}\n", 1)
    (folder / f"{PACKED}.yaml").write_text(spec.replace("versions:\n", packing + "versions:\n", 1))
    return folder


async def preload_packed(bootstrap: str, topic: str, n: int, first: int) -> None:
    """`n` tasks as the other regimes' (bench/pipeline_overhead.py), for PACKED."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, acks=1)
    await producer.start()
    try:
        for i in range(first, first + n):
            key, value = task_record(i)
            task = orjson.loads(value)
            task["pipeline"] = PACKED
            await producer.send(topic, key=key, value=orjson.dumps(task))
        await producer.flush()
    finally:
        await producer.stop()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=10_000, help="saturation backlog")
    parser.add_argument("--seconds", type=float, default=30.0, help="each measuring window")
    parser.add_argument("--profile", type=Path, help="py-spy each window into this directory")
    parser.add_argument(
        "--native", action="store_true", help="profile C frames too (py-spy --native)"
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="floors right after the worker at each paced rate: bare pass-throughs, a task's I/O",
    )
    parser.add_argument(
        "--strace", action="store_true", help="count the worker's system calls (strace -c)"
    )
    parser.add_argument(
        "--regimes",
        default=",".join(REGIMES),
        help=f"which regimes, in this order: {','.join(REGIMES)} (pacedN: any rate N/s)",
    )
    args = parser.parse_args()
    regimes = set(args.regimes.split(","))
    unknown = {r for r in regimes - set(REGIMES) if not PACED.fullmatch(r)}
    if unknown:
        parser.error(f"unknown regime(s): {', '.join(sorted(unknown))}")
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    logdir = Path(tempfile.mkdtemp(prefix="llm-streams-cpu-"))
    sim = Sim(rpm=0, tpm=0, latency_ms=0, jitter_ms=0, error_rate=0.0)
    rows: list[tuple[str, int, float, float]] = []
    split: dict[str, dict[str, tuple[float, float]]] = {}
    profiles = {}
    counted: dict[str, tuple[Counter[str], int]] = {}
    try:
        with ApacheKafka(heap_mb=1024) as kafka:
            await warm_up(kafka, 5000)
            settings = worker_settings(kafka, sim, logdir / "worker", "cpu",
                                       pipelines_dir=pipelines_with_packing(logdir / "pipelines"))  # fmt: skip
            await ensure_topics(settings)
            env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_STREAMS_")}
            env.update(settings_env(settings))
            with open(logdir / "worker.log", "wb") as log:
                worker = subprocess.Popen([sys.executable, "-m", "streams.cli", "worker"],
                                          env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
            profiler = Profiler(args.profile, worker.pid, args.native)
            syscalls = Syscalls(args.strace, worker.pid)
            try:
                outcomes, stop_reading, reader, producer = await traffic(kafka, settings)
            except BaseException:  # not left running without its broker
                stop(worker)
                raise
            sent = 0

            async def measure(name: str, seconds: float) -> None:
                done, cpu, threads = await window(worker, outcomes, profiler, syscalls, name,
                                                  seconds)  # fmt: skip
                rows.append((name, done, cpu, seconds))
                split[name] = threads
                calls = syscalls.finish()
                if calls is not None:
                    counted[name] = (calls, done)
                got = profiler.finish()
                if got is not None:
                    profiles[name] = got

            floors: dict[str, Floor] = {}  # --floor: started before the paced regimes
            limited_calls: dict[str, int] = {}  # HTTP status -> the simulator's calls, limited
            try:
                # Warm-up: join the group, load the tokenizer and the pipelines.
                sent += await paced(producer, settings.topics.tasks, 20, 5, sent)
                await outcomes.until(sent, 120)
                if "idle" in regimes:
                    await measure("idle (per second)", args.seconds)
                if "saturation" in regimes:  # a backlog, answered at once; measured draining
                    await preload(kafka.bootstrap, settings.topics.tasks, args.tasks, sent)
                    sent += args.tasks
                    await asyncio.sleep(1.0)  # past the ramp-up
                    await measure("saturation", 5.0)
                    await outcomes.until(sent, 600)
                sim.call("/sim/config", {"latency_ms": 300, "latency_jitter_ms": 100})
                for name, (script, extra) in FLOORS.items() if args.floor else ():
                    floors[name] = Floor(kafka, script, extra, logdir,
                                         f"{sim.base}/v1/chat/completions")  # fmt: skip
                    await floors[name].start()
                for rate in paced_rates(regimes):
                    sent, _ = await at_rate(producer, settings.topics.tasks, rate, args.seconds,
                                            sent, outcomes,
                                            functools.partial(measure, f"paced {rate}/s",
                                                              args.seconds))  # fmt: skip
                    for name, pass_through in floors.items():  # right after, the same rate
                        done, cpu = await pass_through.measure(rate, args.seconds)
                        rows.append((f"{name} {rate}/s", done, cpu, args.seconds))
                if "packed" in regimes:  # a backlog of packed tasks, answered at once
                    sim.call("/sim/config", {"latency_ms": 0, "latency_jitter_ms": 0})
                    await preload_packed(kafka.bootstrap, settings.topics.tasks, args.tasks, sent)
                    sent += args.tasks
                    await asyncio.sleep(1.0)  # past the ramp-up
                    await measure("packed (20 per request)", 5.0)
                    await outcomes.until(sent, 600)
                if "limited" in regimes:  # a backlog held to 3,000 RPM (50/s), learned
                    sim.call("/sim/config", {"rpm": 3000, "tpm": 3000 * 2000})
                    backlog = int(50 * (args.seconds + 10))
                    await preload(kafka.bootstrap, settings.topics.tasks, backlog, sent)
                    sent += backlog
                    await asyncio.sleep(5.0)  # past learning the limit
                    before = sim.call("/sim/stats")["by_status"]
                    await measure("rate-limited 3,000 RPM", args.seconds)
                    after = sim.call("/sim/stats")["by_status"]
                    limited_calls = {code: after.get(code, 0) - before.get(code, 0)
                                     for code in after}  # fmt: skip
                    await outcomes.until(sent, 900)
            finally:
                for pass_through in floors.values():
                    await pass_through.close()
                await wind_down(producer, stop_reading, reader, worker)
    finally:
        stop(sim.proc)
    print("one worker, comment-analysis pipeline (spans, redaction on); Apache Kafka 4.1.1; "
          "worker CPU from /proc")  # fmt: skip
    print(f"{'regime':<30} {'tasks':>7} {'tasks/s':>8} {'CPU ms/task':>12} {'CPU ms/s':>9}")
    for name, done, cpu, seconds in rows:
        per_task = f"{cpu * 1000 / done:.2f}" if done else "-"
        print(
            f"{name:<30} {done:>7} {done / seconds:>8.1f} {per_task:>12} {cpu * 1000 / seconds:>9.1f}"
        )
    if limited_calls:  # what the window's calls met: a 429 costs a call and its retry
        done = next(r[1] for r in rows if r[0].startswith("rate-limited"))
        answered = limited_calls.get("200", 0)
        throttled = limited_calls.get("429", 0)
        print(f"rate-limited window: {answered} calls answered, {throttled} refused with 429 "
              f"({throttled / max(1, answered + throttled):.1%}), "
              f"{(answered + throttled) / max(1, done):.2f} calls a task")  # fmt: skip
    print("\nCPU ms/s per thread, of it in the kernel (the main thread runs the event loop and "
          "the Kafka consumer; with LLM_STREAMS_KAFKA__CONSUMER_THREAD the consumer has its "
          "own)")  # fmt: skip
    for name, threads in split.items():
        seconds = next(r[3] for r in rows if r[0] == name)
        busy = ", ".join(
            f"{t} {c * 1000 / seconds:.1f} (kernel {k * 1000 / seconds:.1f})"
            for t, (c, k) in sorted(threads.items(), key=lambda x: -x[1][0])[:5]
            if c > 0
        )
        print(f"  {name:<26} {busy}")
    for name, (calls, done) in counted.items():
        seconds = next(r[3] for r in rows if r[0] == name)
        per = f"per task ({done})" if done else "per second"
        top = ", ".join(f"{call} {n / (done or seconds):.1f}" for call, n in calls.most_common(8))
        print(f"\n== system calls {per}, {name}: {top}")
    for name, (own, total, samples) in profiles.items():
        print(f"\n== py-spy, {name}: {samples} samples of busy threads")
        print("  top by own time:")
        for frame, n in own.most_common(12):
            print(f"    {n / samples:6.1%}  {frame}")
        print("  top by total time:")
        for frame, n in total.most_common(20):
            print(f"    {n / samples:6.1%}  {frame}")
    print(f"logs: {logdir}")


if __name__ == "__main__":
    asyncio.run(main())
