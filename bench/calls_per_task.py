"""Python function calls per task: the worker against the task's I/O on the same stack.

CPU time per task moves with the host (this machine class measured the same code 2.4x
apart on two days, bench/BENCHMARKS.md); how many Python functions a task runs through
does not. This counts them with cProfile in the worker's event loop thread, and in the
task's-I/O floor of bench/cpu_per_task.py (a Faust agent, its consumer on the app's
loop as the worker's, doing per record one chat completion to the same simulator and
two acked writes: what any implementation on this stack pays per task), in one run:

1. the worker paced at `--rate` tasks/s, answers in 300 +- 100 ms, over `--seconds`;
2. the floor at the same rate, over `--seconds`;
3. the worker at saturation: `--tasks` pre-loaded, answered at 0 ms, over 5 s of the
   drain.

Printed: calls per task by where the function lives (the project, each library, the
standard library, builtins: C functions called from Python), the worker's against the
floor's, the project's functions called most per task, and the builtins the worker
calls more than the floor, with their callers. Tasks per window: the
worker's `decode_task` calls in it (one a task it took up), the floor's outcomes read
in it (edges: a few either way). cProfile slows what it profiles: the
counts are the figure, not the time. A coroutine's every resumption counts as a call,
in the worker and the floor alike. The profiler comes in through `bench/probe` on the
processes' PYTHONPATH (`BENCH_CALLS_DIR`).

    python bench/calls_per_task.py [--rate 50] [--seconds 20] [--tasks 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pstats
import re
import sys
import sysconfig
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_per_task import FLOORS, Floor, Outcomes, paced, traffic, wind_down, worker_settings
from pipeline_overhead import HERE, group_stable, preload, spawn_worker, stop, warm_up
from rate_limit_utilisation import Sim

from streams.dev.brokers.apache import ApacheKafka
from streams.kafka.topics import ensure_topics

PROBE = HERE / "probe"
STDLIB = sysconfig.get_paths()["stdlib"]
FLOOR = "task's I/O on Faust in-loop"


@dataclass
class Counts:
    """A window's calls per task: by group, by function of the project, by builtin and by
    builtin and its caller; and the tasks it saw."""

    groups: Counter[str] = field(default_factory=Counter)
    ours: Counter[str] = field(default_factory=Counter)
    builtins: Counter[str] = field(default_factory=Counter)
    callers: Counter[tuple[str, str]] = field(default_factory=Counter)
    tasks: int = 1


class Windows:
    """The profiling windows of one process (bench/probe/sitecustomize.py)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.i = folder, 0
        folder.mkdir(parents=True)

    def open(self) -> None:
        (self.folder / f"on-{self.i}").write_text("")

    async def close(self) -> pstats.Stats:
        (self.folder / f"off-{self.i}").write_text("")
        done = self.folder / f"done-{self.i}"
        for _ in range(1200):
            if done.exists():
                break
            await asyncio.sleep(0.05)
        else:
            raise RuntimeError(f"no profile from {self.folder} (is bench/probe on its path?)")
        stats = pstats.Stats(str(self.folder / f"{self.i}.prof"))
        self.i += 1
        return stats


def probed(folder: Path) -> None:
    """The next process started from here profiles its loop in windows under `folder`."""
    os.environ["BENCH_CALLS_DIR"] = str(folder)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(PROBE), os.environ.get("PYTHONPATH")) if p
    )


def where(path: str) -> str:
    """The group a function's file belongs to."""
    if path == "~" or path.startswith("<"):
        return "builtins (C, called from Python)"
    if "site-packages" in path:
        return path.split("site-packages/")[1].split("/")[0].removesuffix(".py")
    if "/streams/" in path:
        return "llm-streams"
    if path.startswith(str(HERE)):
        return "the floor's own script"
    if path.startswith(STDLIB):
        return "standard library"
    return "other"


def tasks_in(stats: pstats.Stats, read: int) -> int:
    """The tasks a window saw: the worker's `decode_task` calls (one a task taken up,
    exact), else (the floor) the outcomes read in it."""
    decoded = sum(calls for (path, _, name), (_, calls, *_rest) in stats.stats.items()  # type: ignore[attr-defined]
                  if name == "decode_task" and path.endswith("contract/records.py"))  # fmt: skip
    return decoded or max(read, 1)


def per_task(stats: pstats.Stats, tasks: int) -> Counts:
    """Calls per task by group, by function of the project, and by builtin."""
    counts = Counts(tasks=tasks)
    for (path, line, name), (_, calls, *_rest) in stats.stats.items():  # type: ignore[attr-defined]
        group = where(path)
        counts.groups[group] += calls / tasks
        if group == "llm-streams":
            counts.ours[f"{short(path)}:{line} {name}"] += calls / tasks
        elif path == "~":
            name = re.sub(r" at 0x[0-9a-f]+", "", name)  # the same builtin in every process
            counts.builtins[name] += calls / tasks
            for (cpath, cline, cname), (_, ccalls, *_r) in _rest[-1].items():
                counts.callers[name, f"{short(cpath)}:{cline} {cname}"] += ccalls / tasks
    return counts


def short(path: str) -> str:
    """A function's file, from its package or the standard library down."""
    for root in ("site-packages/", "/streams/", f"{STDLIB}/"):
        if root in path:
            return path.split(root, 1)[1]
    return path


async def profiled(windows: Windows, outcomes: Outcomes, work: asyncio.Future[int] | None,
                   seconds: float) -> tuple[pstats.Stats, int]:  # fmt: skip
    """One window of `seconds` (while `work` runs, when given): its statistics and the
    outcomes read meanwhile."""
    windows.open()
    await asyncio.sleep(0.2)  # the watcher's poll and the loop's turn
    before = outcomes.count
    await asyncio.sleep(seconds)
    tasks = outcomes.count - before
    stats = await windows.close()
    if work is not None:
        await work
    return stats, tasks


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=int, default=50, help="paced tasks/s")
    parser.add_argument("--seconds", type=float, default=20.0, help="each paced window")
    parser.add_argument("--tasks", type=int, default=10_000, help="the saturation backlog")
    args = parser.parse_args()
    logdir = Path(tempfile.mkdtemp(prefix="llm-streams-calls-"))
    sim = Sim(0, 0, latency_ms=300, jitter_ms=100, error_rate=0.0)
    results: dict[str, Counts] = {}
    try:
        with ApacheKafka(heap_mb=1024) as kafka:
            await warm_up(kafka, 5000)
            settings = worker_settings(kafka, sim, logdir / "worker", "calls")
            await ensure_topics(settings)
            path_before = os.environ.get("PYTHONPATH")
            probed(logdir / "worker-profiles")
            worker = spawn_worker(settings, logdir / "worker.log")
            worker_windows = Windows(logdir / "worker-profiles")
            script, extra = FLOORS[FLOOR]
            floor = Floor(kafka, script, extra, logdir, f"{sim.base}/v1/chat/completions")
            floor_windows = Windows(logdir / "floor-profiles")
            stop_reading, reader, producer = asyncio.Event(), None, None
            try:
                probed(logdir / "floor-profiles")
                try:
                    await floor.start()
                finally:  # what starts from here on is not profiled
                    os.environ.pop("BENCH_CALLS_DIR")
                    if path_before is None:
                        os.environ.pop("PYTHONPATH")
                    else:
                        os.environ["PYTHONPATH"] = path_before
                outcomes, stop_reading, reader, producer = await traffic(kafka, settings)
                await group_stable(settings, 1)
                # Warm: the tokenizer, the pipelines, the limiter's first word.
                sent = await paced(producer, settings.topics.tasks, 20, 5, 0)
                await outcomes.until(sent, 120)
                pace = args.seconds + 2.0  # traffic before, during and after the window
                for name, windows, out, topic, send in (
                    (f"the worker, {args.rate}/s", worker_windows, outcomes,
                     settings.topics.tasks, producer),
                    (f"the floor, {args.rate}/s", floor_windows, floor.outcomes, floor.source,
                     floor.producer),
                ):  # fmt: skip
                    assert send is not None
                    ours = windows is worker_windows
                    first = sent if ours else floor.sent
                    load = asyncio.ensure_future(paced(send, topic, args.rate, pace, first))
                    await asyncio.sleep(1.0)
                    stats, tasks = await profiled(windows, out, load, args.seconds)
                    if ours:
                        sent += load.result()
                        await outcomes.until(sent, 120)
                    else:
                        floor.sent += load.result()
                    tasks = tasks_in(stats, tasks)
                    results[name] = per_task(stats, tasks)
                sim.call("/sim/config", {"latency_ms": 0, "latency_jitter_ms": 0})
                await preload(kafka.bootstrap, settings.topics.tasks, args.tasks, sent)
                sent += args.tasks
                await asyncio.sleep(1.0)  # past the ramp-up
                stats, tasks = await profiled(worker_windows, outcomes, None, 5.0)
                tasks = tasks_in(stats, tasks)
                results["the worker, saturation"] = per_task(stats, tasks)
                await outcomes.until(sent, 600)
            finally:
                await floor.close()
                await wind_down(producer, stop_reading, reader, worker)
    finally:
        stop(sim.proc)
    report(results, args.rate)
    print(f"logs: {logdir}")


def report(results: dict[str, Counts], rate: int) -> None:
    names = list(results)
    print("Python function calls per task (cProfile on the event loop's thread); tasks "
          "counted in each window: " + ", ".join(f"{n} {results[n].tasks}" for n in names))  # fmt: skip
    worker, floor = results[names[0]], results[names[1]]
    groups = sorted(set().union(*(r.groups for r in results.values())),
                    key=lambda g: -(worker.groups[g] - floor.groups[g]))  # fmt: skip
    print(f"{'':34}" + "".join(f"{n:>26}" for n in names) + f"{'worker - floor':>16}")
    for group in groups:
        cells = "".join(f"{results[n].groups[group]:>26.1f}" for n in names)
        print(f"{group[:34]:<34}{cells}{worker.groups[group] - floor.groups[group]:>+16.1f}")
    totals = [sum(results[n].groups.values()) for n in names]
    print(f"{'total':<34}" + "".join(f"{t:>26.1f}" for t in totals)
          + f"{totals[0] - totals[1]:>+16.1f}")  # fmt: skip
    print(f"worker / floor at {rate}/s: {totals[0] / totals[1]:.2f}x the calls")
    print(f"\nthe project's functions called most per task ({names[0]}):")
    for function, calls in worker.ours.most_common(15):
        print(f"  {calls:7.1f}  {function}")
    print(f"\nthe builtins called more per task ({names[0]} - {names[1]}):")
    more = {name: worker.builtins[name] - floor.builtins[name] for name in worker.builtins}
    for name, extra in sorted(more.items(), key=lambda item: -item[1])[:12]:
        print(f"  {extra:+7.1f}  {name} ({worker.builtins[name]:.1f} vs "
              f"{floor.builtins[name]:.1f}), the worker's from:")  # fmt: skip
        callers = [(calls, caller) for (of, caller), calls in worker.callers.items() if of == name]
        for calls, caller in sorted(callers, reverse=True)[:3]:
            print(f"  {'':7}    {calls:6.1f}  {caller}")


if __name__ == "__main__":
    asyncio.run(main())
