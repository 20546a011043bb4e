"""Rate-limit utilisation: how much of a provider's RPM limit the worker turns into answers.

One run, one broker (Apache Kafka 4.1.1 from jars), one LLM simulator process
with an RPM limit R (sub-minute enforcement, 1 s bursts), a TPM limit, latency
300 +- 100 ms and 1% 500s. Phases:

1. llm-streams, one worker, limit not configured (learned from headers);
2. a naive client on the same tasks: asyncio.gather + semaphore + tenacity
   retrying 429/5xx with random exponential backoff, as commonly written;
3. two, then four llm-streams workers sharing the key (one consumer group), each
   learning its share from the trend of `remaining` (`--styles`: counted against the
   minute, as OpenAI does, and/or against the enforcing second);
4. one worker while the simulator's limit is halved mid-run;
5. a worker leaving (two, then one) and joining (one, then two) 30 s in: how long
   until the key is used again (rebalance included).

Printed per phase: successful requests/min over the busy span / R, and the
share of requests answered 429.

    python bench/rate_limit_utilisation.py [--rpm 3000] [--tasks 3000] [--phases 1,2,3,4,5]
        [--workers 2,4] [--styles minute,second] [--moves leave,join] [--timeline]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_overhead import group_stable, preload, stop, task_record, warm_up

from streams.dev.brokers.apache import ApacheKafka
from streams.dev.brokers.common import free_port, wait_for_port
from streams.kafka.topics import ensure_topics
from streams.settings import load_settings, settings_env

DEAD_LETTERS: Counter[str] = Counter()
# The window `x-ratelimit-remaining-requests` is counted against, by header style.
REMAINING_WINDOWS = {"minute": 60.0, "second": 1.0}
LOGDIR: Path | None = None


class Sim:
    KEY = "bench-key"  # the API key the simulator takes

    def __init__(self, rpm: int, tpm: int, *, latency_ms: int = 300, jitter_ms: int = 100,
                 error_rate: float = 0.01) -> None:  # fmt: skip
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "streams.cli", "simulate-llm", "--port", str(self.port),
             "--latency-ms", str(latency_ms), "--jitter-ms", str(jitter_ms), "--rpm", str(rpm),
             "--tpm", str(tpm), "--error-500-rate", str(error_rate), "--api-key", self.KEY],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_for_port("127.0.0.1", self.port, 30)
        self.base = f"http://127.0.0.1:{self.port}"

    def call(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = orjson.dumps(body) if body is not None else None
        req = urllib.request.Request(f"{self.base}{path}", data=data, method="POST" if data else "GET",
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req) as r:
            return orjson.loads(r.read())  # type: ignore[no-any-return]

    def reset(self, rpm: int) -> None:
        self.call("/sim/config", {"rpm": rpm})
        time.sleep(2)  # let the simulator's buckets refill between phases
        self.call("/sim/reset", {})


def figures(stats: dict[str, Any], rpm: float, span_s: float) -> tuple[float, float, float]:
    """Successful RPM over the busy span / R, the same over the middle 80% of the
    busy seconds (steady state, without ramp-up and the last stragglers), 429 share."""
    if LOGDIR is not None:  # the simulator's count per second, for a look afterwards
        (LOGDIR / f"sim-{uuid.uuid4().hex[:6]}.json").write_bytes(orjson.dumps(stats))
    ok = stats["by_status"].get("200", 0)
    total = stats["requests"]
    per_min = ok / span_s * 60
    seconds = [
        c.get("200", 0) for _, c in sorted(stats["per_second"].items(), key=lambda kv: int(kv[0]))
    ]
    busy = [x for x in seconds if x]
    cut = len(busy) // 10
    middle = busy[cut : len(busy) - cut] or busy
    steady = sum(middle) / len(middle) * 60 / rpm
    return per_min / rpm, steady, stats["by_status"].get("429", 0) / max(total, 1)


async def run_workers(kafka: ApacheKafka, sim: Sim, n_tasks: int, workers: int, logdir: Path,
                      on_progress: Any = None, change: tuple[str, float] | None = None,
                      changed: dict[str, float] | None = None) -> float:  # fmt: skip
    """Busy span (first to last outcome) of n_tasks through `workers` worker processes.
    `change`: ("join", s) starts one more worker s seconds into the busy span, ("leave",
    s) stops one; the simulator's clock at that moment goes into `changed["at"]`."""
    suffix = uuid.uuid4().hex[:6]
    settings = load_settings(
        app_id=f"util-{suffix}",
        kafka={"broker_url": kafka.url, "partitions": 4},
        topics={n: f"{n}-{suffix}" for n in ("tasks", "replay", "results", "dead_letters", "review")},
        llm={"base_url": f"{sim.base}/v1", "api_key": sim.KEY, "model": "sim-1",
             "max_attempts": 6, "task_deadline_s": 300},
        batch={"size": 200, "window_s": 0.05, "concurrency": 64},
        data_dir=logdir / f"w-{suffix}",
        log_level="warning",
    )  # fmt: skip
    await ensure_topics(settings)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_STREAMS_")}
    env.update(settings_env(settings))
    procs: list[subprocess.Popen[bytes]] = []

    def spawn() -> None:
        i = len(procs)
        env_i = {**env, "LLM_STREAMS_WEB_PORT": str(free_port()),
                 # each worker its own task store (a store directory takes one process)
                 "LLM_STREAMS_DATA_DIR": str(logdir / f"w-{suffix}-{i}")}  # fmt: skip
        with open(logdir / f"worker-{suffix}-{i}.log", "wb") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "streams.cli", "worker"],
                                          env=env_i, stdout=log, stderr=subprocess.STDOUT))  # fmt: skip

    for _ in range(workers):
        spawn()
    # Tasks come once every worker is in the group: the figure is the workers sharing the
    # key, not their joins one after the other (each a rebalance; phase 5 times those).
    await group_stable(settings, workers, timeout_s=180)
    await preload(kafka.bootstrap, settings.topics.tasks, n_tasks)
    consumer = AIOKafkaConsumer(
        settings.topics.results, settings.topics.dead_letters,
        bootstrap_servers=kafka.bootstrap, group_id=f"u-{suffix}",
        auto_offset_reset="earliest", enable_auto_commit=False,
    )  # fmt: skip
    await consumer.start()
    seen, first, last = 0, 0.0, 0.0
    try:
        deadline = time.monotonic() + 900
        while seen < n_tasks and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=200)
            for tp, records in batch.items():
                if tp.topic == settings.topics.dead_letters:
                    for rec in records:
                        DEAD_LETTERS[orjson.loads(rec.value)["error"]["code"]] += 1
            got = sum(len(v) for v in batch.values())
            if got:
                now = time.monotonic()
                first = first or now
                last = now
                seen += got
            if on_progress is not None:
                on_progress(seen, first)
            if (
                change
                and changed is not None
                and not changed
                and first
                and (time.monotonic() - first > change[1])
            ):
                changed["at"] = sim.call("/sim/stats")["now_s"]
                if change[0] == "join":
                    spawn()
                else:  # a graceful stop: the worker leaves the group at once
                    await asyncio.to_thread(stop, procs[0])
    finally:
        await consumer.stop()
        for p in procs:
            stop(p)
    if seen < n_tasks:
        raise RuntimeError(f"only {seen}/{n_tasks} outcomes; logs in {logdir}")
    return last - first


async def run_naive(sim: Sim, n_tasks: int, concurrency: int = 64) -> float:
    """The common hand-rolled client: gather + semaphore + tenacity."""
    import openai
    from tenacity import (
        AsyncRetrying,
        retry_if_exception_type,
        stop_after_attempt,
        wait_random_exponential,
    )

    client = openai.AsyncOpenAI(base_url=f"{sim.base}/v1", api_key=sim.KEY, max_retries=0)
    sem = asyncio.Semaphore(concurrency)
    schema = orjson.loads(
        (
            Path(__file__).resolve().parents[1] / "schemas" / "comment-analysis.output.schema.json"
        ).read_bytes()
    )
    texts = [orjson.loads(task_record(i)[1])["input"]["text"] for i in range(n_tasks)]

    async def one(text: str) -> None:
        async with sem:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type((openai.RateLimitError, openai.InternalServerError)),
                wait=wait_random_exponential(multiplier=0.5, max=20), stop=stop_after_attempt(6),
            ):  # fmt: skip
                with attempt:
                    await client.chat.completions.create(
                        model="sim-1", max_tokens=400,
                        messages=[{"role": "user", "content": f"<comment>{text}</comment>"}],
                        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
                    )  # fmt: skip

    start = time.monotonic()
    await asyncio.gather(*(one(t) for t in texts), return_exceptions=True)
    span = time.monotonic() - start
    await client.close()
    return span


def recovery(stats: dict[str, Any], change_at: float, rpm: int, window: int = 5,
             hold: int = 15) -> tuple[float, int]:  # fmt: skip
    """Seconds after the change until the key is used again for good: from then on, every
    `window` seconds in a row (over `hold` s) average >= 0.95 of the limit with <= 0.5%
    of their requests refused. Also the 429s until then."""
    per_s = {int(k): v for k, v in stats["per_second"].items()}
    start = int(change_at) + 1  # the first whole second after the change

    def good(t: int) -> bool:
        seconds = [per_s.get(t + i, {}) for i in range(window)]
        ok = sum(c.get("200", 0) for c in seconds)
        refused = sum(c.get("429", 0) for c in seconds)
        total = max(1, sum(sum(c.values()) for c in seconds))
        return bool(ok >= 0.95 * rpm / 60 * window and refused <= 0.005 * total)

    for t in range(start, max(per_s, default=start) - window - hold + 2):
        if all(good(t + i) for i in range(hold)):
            return t - change_at, sum(per_s.get(s, {}).get("429", 0) for s in range(start, t))
    return float("inf"), sum(c.get("429", 0) for s, c in per_s.items() if s >= start)


def timeline(stats: dict[str, Any], change_at: float, kind: str, before_s: int = 3,
             after_s: int = 20) -> str:  # fmt: skip
    """Answers / 429s per second from a little before the change to well after it."""
    per_s = {int(k): v for k, v in stats["per_second"].items()}
    at = int(change_at)
    cells = [f"{s - at:+d}:{per_s.get(s, {}).get('200', 0)}/{per_s.get(s, {}).get('429', 0)}"
             for s in range(at - before_s, at + after_s)]  # fmt: skip
    return f"{kind} at {change_at:.1f} s (answers/429s per second): " + " ".join(cells)


def adaptation(stats: dict[str, Any], change_at: float, new_rpm: int) -> tuple[float, int]:
    """Seconds after the change until 429s stop for good, and 429s in that time."""
    per_s = {int(k): v for k, v in stats["per_second"].items()}
    throttled = [s for s, c in per_s.items() if s >= change_at and c.get("429", 0)]
    last_429 = max(throttled) + 1 - change_at if throttled else 0.0
    return last_429, sum(per_s[s].get("429", 0) for s in throttled)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rpm", type=int, default=3000)
    parser.add_argument("--tasks", type=int, default=3000)
    parser.add_argument("--phases", default="1,2,3,4,5", help="Which phases to run.")
    parser.add_argument("--workers", default="2,4", help="Phase 3: workers sharing the key.")
    parser.add_argument(
        "--styles",
        default="minute",
        help="Phase 3: which `remaining` styles, minute (OpenAI's) and/or second "
        "(counted against the enforcing second, as some gateways do).",
    )
    parser.add_argument("--moves", default="leave,join", help="Phase 5: which changes to time.")
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="Phase 5: print answers and 429s per second around each change.",
    )
    args = parser.parse_args()
    phases = {int(p) for p in args.phases.split(",")}
    rpm, n = args.rpm, args.tasks
    tpm = rpm * 800  # ~690 tokens estimated per call: RPM is the binding limit
    logdir = Path(tempfile.mkdtemp(prefix="llm-streams-util-"))
    global LOGDIR
    LOGDIR = logdir
    sim = Sim(rpm, tpm)
    rows = []
    try:
        with ApacheKafka(heap_mb=1024) as kafka:
            await warm_up(kafka, 5000)
            if 1 in phases:
                sim.reset(rpm)
                span = await run_workers(kafka, sim, n, 1, logdir)
                rows.append(("llm-streams, 1 worker", *figures(sim.call("/sim/stats"), rpm, span)))
            if 2 in phases:
                sim.reset(rpm)
                span = await run_naive(sim, n)
                rows.append(
                    ("naive gather+semaphore+tenacity", *figures(sim.call("/sim/stats"), rpm, span))
                )
            styles = args.styles.split(",") if 3 in phases else []
            for style in styles:
                sim.call("/sim/config", {"remaining_window_s": REMAINING_WINDOWS[style]})
                for workers in (int(w) for w in args.workers.split(",")):
                    sim.reset(rpm)
                    span = await run_workers(kafka, sim, workers * n, workers, logdir)
                    label = f" ({style})" if len(styles) > 1 else ""
                    rows.append((f"llm-streams, {workers} workers, one key{label}",
                                 *figures(sim.call("/sim/stats"), rpm, span)))  # fmt: skip
            sim.call("/sim/config", {"remaining_window_s": REMAINING_WINDOWS["minute"]})
            moves = []
            wanted = set(args.moves.split(","))
            for kind, before in (("leave", 2), ("join", 1)) if 5 in phases else ():
                if kind not in wanted:
                    continue
                sim.reset(rpm)
                moved: dict[str, float] = {}
                await run_workers(kafka, sim, 2 * n, before, logdir, change=(kind, 30.0),
                                  changed=moved)  # fmt: skip
                stats = sim.call("/sim/stats")
                took, refused = recovery(stats, moved.get("at", 0.0), rpm)
                if args.timeline:
                    print(timeline(stats, moved.get("at", 0.0), kind))
                moves.append((f"{before} -> {before + (1 if kind == 'join' else -1)} workers",
                              took, refused))  # fmt: skip
            settle_s, storm = -1.0, 0
            changed: dict[str, float] = {}

            def halve(seen: int, first: float) -> None:
                if not changed and first and time.monotonic() - first > 20:
                    sim.call("/sim/config", {"rpm": rpm // 2})
                    changed["at"] = sim.call("/sim/stats")["now_s"]

            if 4 in phases:
                sim.reset(rpm)
                await run_workers(kafka, sim, 2 * n, 1, logdir, on_progress=halve)
                stats = sim.call("/sim/stats")
                settle_s, storm = adaptation(stats, changed.get("at", 0.0), rpm // 2)
    finally:
        stop(sim.proc)
    print(
        f"simulator: RPM limit R={rpm} (1 s bursts), TPM {tpm}, latency 300+-100 ms, 1% 500s; {n} tasks per phase"
    )
    print(f"{'phase':<34} {'successful RPM / R':>19} {'steady-state':>13} {'429 share':>10}")
    for name, util, steady, share in rows:
        print(f"{name:<34} {util:>19.3f} {steady:>13.3f} {share:>9.2%}")
    for name, took, refused in moves:
        print(f"{name} 30 s in: back to >= 0.95 of R with <= 0.5% 429s (5 s in a row) after "
              f"{took:.0f} s ({refused} 429s until then)")  # fmt: skip
    if settle_s >= 0:
        print(
            f"limit halved to {rpm // 2} mid-run: 429s stopped {settle_s:.1f} s after the change ({storm} 429s in that time)"
        )
    print(f"dead letters by code, all llm-streams phases: {dict(DEAD_LETTERS) or 'none'}")
    print(f"logs: {logdir}")


if __name__ == "__main__":
    asyncio.run(main())
