"""The same task's path, back to back and alone: what a thin stream pays for arriving alone.

One process, one `streams.api.Analyzer` (the worker's processor: the shipped
comment-analysis pipeline, limiter, breaker, retries, validation, metrics) against
the LLM simulator answering at once, on uvloop as the worker runs. Each task's
CPU is the thread's own (`time.thread_time`) across its `analyze` call, in turns:

- back to back: the next task starts when the last one ends;
- one task every 100 ms (10 tasks/s) or 20 ms (50/s), the thread asleep between;
- one task every 100 ms, the thread spinning between (never idle).

A second pass counts the Python function calls per task (`sys.setprofile`) back to
back and alone: the same work either way. A control with no I/O and no event loop
(JSON and a regex over 40 small records) runs the same turns, so what the host
does to a path that runs alone is seen apart from the project's code.

    python bench/cold_path.py [--tasks 80] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_overhead import stop, task_record
from rate_limit_utilisation import Sim

from streams.api import Analyzer
from streams.settings import load_settings
from streams.worker.run import _new_loop

GAPS = {  # turn: (seconds between tasks, spinning rather than asleep)
    "back to back": (0.0, False),
    "every 20 ms, asleep": (0.02, False),
    "every 100 ms, asleep": (0.1, False),
    "every 100 ms, spinning": (0.1, True),
}

CONTROL = [{"task_id": f"t-{i}", "text": "The zip broke after two days " * 3} for i in range(40)]
EMAIL = re.compile(r"\b(\w+)@(\w+)\.com\b")


def control() -> int:
    """Pure Python, no I/O: ~0.2 ms back to back."""
    return sum(len(EMAIL.sub("x", json.loads(json.dumps(d))["text"])) for d in CONTROL)


async def turn(run: Callable[[], Awaitable[object]], gap: float, spin: bool, n: int) -> float:
    """Median CPU seconds of the thread per `run()`, `n` runs `gap` apart."""
    spent = []
    for _ in range(n):
        before = time.thread_time()
        await run()
        spent.append(time.thread_time() - before)
        if spin:
            until = time.perf_counter() + gap
            while time.perf_counter() < until:
                pass
        elif gap:
            await asyncio.sleep(gap)
    return statistics.median(spent)


def calls_per_run(loop: asyncio.AbstractEventLoop, run: Callable[[], Awaitable[object]],
                  gap: float, n: int) -> float:  # fmt: skip
    """Python function calls per `run()` (the profiler hook sees every call the loop runs)."""
    count = [0]

    def hook(frame: object, event: str, arg: object) -> None:
        if event == "call":
            count[0] += 1

    async def runs() -> None:
        for _ in range(n):
            sys.setprofile(hook)
            await run()
            sys.setprofile(None)
            await asyncio.sleep(gap)

    loop.run_until_complete(runs())
    return count[0] / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=80, help="tasks per turn")
    parser.add_argument("--rounds", type=int, default=2, help="times every turn runs")
    args = parser.parse_args()
    sim = Sim(rpm=0, tpm=0, latency_ms=0, jitter_ms=0, error_rate=0.0)
    loop = _new_loop()
    asyncio.set_event_loop(loop)
    try:
        with tempfile.TemporaryDirectory(prefix="llm-streams-cold-") as data:
            settings = load_settings(
                llm={"base_url": f"{sim.base}/v1", "api_key": sim.KEY, "model": "sim-1"},
                data_dir=Path(data), log_level="warning",
            )  # fmt: skip
            analyzer = Analyzer(settings)
            sent = [0]
            kinds: dict[str, int] = {}

            async def task() -> None:
                outcome = await analyzer.analyze(task_record(sent[0])[1])
                kinds[outcome.kind] = kinds.get(outcome.kind, 0) + 1
                sent[0] += 1

            async def pure() -> None:
                control()

            loop.run_until_complete(turn(task, 0.0, False, 300))  # warm-up
            loop.run_until_complete(turn(pure, 0.0, False, 500))
            rows: dict[str, list[tuple[float, float]]] = {name: [] for name in GAPS}
            for _ in range(args.rounds):
                for name, (gap, spin) in GAPS.items():
                    measured = (loop.run_until_complete(turn(task, gap, spin, args.tasks)),
                                loop.run_until_complete(turn(pure, gap, spin, args.tasks)))  # fmt: skip
                    rows[name].append(measured)
            calls = {name: calls_per_run(loop, task, gap, 40)
                     for name, gap in (("back to back", 0.0), ("every 100 ms", 0.1))}  # fmt: skip
            loop.run_until_complete(analyzer.close())
    finally:
        loop.close()
        stop(sim.proc)
    base = rows["back to back"]
    print("one Analyzer (comment-analysis), the simulator answering at once; uvloop; "
          "CPU of the thread per call, median")  # fmt: skip
    print(f"{'turn':<24} {'round':>5} {'task ms':>8} {'x b2b':>8} {'control ms':>11} {'x':>6}")
    for name, measured in rows.items():
        for i, (task_s, pure_s) in enumerate(measured):
            b_task, b_pure = base[i]
            print(f"{name:<24} {i + 1:>5} {task_s * 1000:>8.3f} {task_s / b_task:>7.2f}x "
                  f"{pure_s * 1000:>10.3f} {pure_s / b_pure:>5.2f}x")  # fmt: skip
    print(f"\nPython function calls per task: back to back {calls['back to back']:.0f}, "
          f"one every 100 ms {calls['every 100 ms']:.0f}")  # fmt: skip
    print(f"outcomes: {kinds}")


if __name__ == "__main__":
    main()
