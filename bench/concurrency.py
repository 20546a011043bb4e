"""Concurrency against a real model server that sends no rate limits: goodput of the
learned limit against the best fixed one, found by a sweep in the same run.

llama.cpp's own server (streams.dev.llamacpp: the xllamacpp wheel, SmolLM2-135M-
Instruct, `--slots` slots), the worker's processor (the Python API's, the same code),
64 tasks offered at once. Phases:

1. fixed limits 1 .. 2 x slots (learning off): tasks answered per second, timeouts;
2. learned, told nothing by settings (the server says its slots in /props);
3. learned from the server's timings alone (its /props not asked);
4. no limit at all (what the worker did before: every task's call at once).

Printed per phase: answered/s, its ratio to the best fixed limit, attempts that timed
out, breaker openings, the limit it ended at.

    python bench/concurrency.py [--slots 2] [--tasks 64] [--read-timeout 8]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from streams.api import Analyzer
from streams.dev.llamacpp import MODEL_NAME, LlamaServer
from streams.llm.endpoint import EndpointFacts
from streams.llm.openai_client import OpenAIClient
from streams.resilience.concurrency import ConcurrencyLimit
from streams.settings import load_settings

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "integration" / "real_server"
TEXTS = ["I love this blender, it works great.", "The zip broke after two days. Terrible.",
         "Great value and fast delivery!", "It stopped working, I want a refund.",
         "Arrived late but the kettle is fine.", "Best headphones I ever had."]  # fmt: skip


def pipelines(tmp: Path) -> tuple[Path, Path]:
    p, s = tmp / "pipelines", tmp / "schemas"
    p.mkdir()
    shutil.copytree(ROOT / "schemas", s)
    shutil.copy(TINY / "tiny-sentiment.output.schema.json", s)
    (p / "tiny.yaml").write_text((TINY / "tiny.yaml").read_text().replace("MODE", "json_schema"))
    return p, s


async def phase(server: LlamaServer, dirs: tuple[Path, Path], n: int, read_timeout: float,
                gate: str, fixed: int = 0) -> dict[str, Any]:  # fmt: skip
    settings = load_settings(
        llm={"base_url": server.base_url, "api_key": "bench-key", "model": MODEL_NAME,
             "read_timeout_s": read_timeout, "task_deadline_s": 600, "max_attempts": 6},
        pipelines_dir=dirs[0], schemas_dir=dirs[1],
    )  # fmt: skip
    describe = OpenAIClient.describe
    if gate == "timings":  # the server's /props not asked: learned from its timings alone

        async def nothing(self: Any, model: str, timeout_s: float = 5.0) -> EndpointFacts:
            return EndpointFacts()

        OpenAIClient.describe = nothing  # type: ignore[method-assign]
    try:
        async with Analyzer(settings) as analyzer:
            client = analyzer.processor.client
            if gate == "fixed":
                client.concurrency = ConcurrencyLimit(start=fixed, learn=False)
            elif gate == "none":
                client.concurrency = ConcurrencyLimit.open_gate()
            stamp = time.monotonic_ns()  # a fresh input per phase: no answer shared
            tasks = [{"task_id": f"t{i}", "pipeline": "tiny-json_schema",
                      "input": {"text": f"{TEXTS[i % len(TEXTS)]} (#{stamp}-{i})"}}
                     for i in range(n)]  # fmt: skip
            started = time.monotonic()
            outcomes = await asyncio.gather(*(analyzer.analyze(t) for t in tasks))
            took = time.monotonic() - started
            m = analyzer.processor.metrics
            timeouts = sum(s.value for f in m.llm_requests.collect() for s in f.samples
                           if s.labels.get("category") == "timeout"
                           and s.name.endswith("_total"))  # fmt: skip
            opened = sum(s.value for f in m.breaker_transitions.collect() for s in f.samples
                         if s.labels.get("to") == "open" and s.name.endswith("_total"))  # fmt: skip
            ended = client.concurrency.current
    finally:
        OpenAIClient.describe = describe  # type: ignore[method-assign]
    answered = sum(1 for o in outcomes if o.kind == "result")
    return {"answered": answered, "per_s": answered / took, "took_s": took,
            "timeouts": int(timeouts), "opened": int(opened), "limit": ended}  # fmt: skip


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=64)
    parser.add_argument("--read-timeout", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds of every phase, in a rotated order; medians reported")  # fmt: skip
    args = parser.parse_args()
    phases: list[tuple[str, str, int]] = [(f"fixed {n}", "fixed", n)
                                          for n in range(1, 2 * args.slots + 1)]  # fmt: skip
    phases += [("learned (slots said)", "learned", 0), ("learned (timings only)", "timings", 0),
               ("no limit (before)", "none", 0)]  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in phases}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = pipelines(Path(tmp))
        with LlamaServer(ctx=1024 * args.slots, parallel=args.slots, api_key="bench-key",
                         log_file=Path(tmp) / "server.log") as server:  # fmt: skip
            await phase(server, dirs, 4, args.read_timeout, "fixed", 1)  # warm the server
            for r in range(args.rounds):  # rotated, so no phase always runs first or warm
                order = phases[r % len(phases) :] + phases[: r % len(phases)]
                for name, gate, n in order:
                    runs[name].append(await phase(server, dirs, args.tasks, args.read_timeout,
                                                  gate, n))  # fmt: skip

    def median(name: str, key: str) -> float:
        values = sorted(float(r[key]) for r in runs[name])
        return values[len(values) // 2] if len(values) % 2 else sum(values[len(values) // 2 - 1:
                                                                             len(values) // 2 + 1]) / 2  # fmt: skip

    best = max(median(name, "per_s") for name, gate, _ in phases if gate == "fixed")
    print(
        f"llama.cpp, {args.slots} slots, {args.tasks} tasks at once, read timeout "
        f"{args.read_timeout:g} s, {args.rounds} rounds (medians); goodput ratio to the best "
        f"fixed limit ({best:.2f}/s)"
    )
    print(
        f"{'phase':<24} {'answered':>8} {'per s':>7} {'ratio':>6} {'timeouts':>8} "
        f"{'opened':>6} {'limits':>8}"
    )
    for name, _, _ in phases:
        answered = min(int(r["answered"]) for r in runs[name])
        per_s = median(name, "per_s")
        limits = ",".join(str(r["limit"]) for r in runs[name])
        print(
            f"{name:<24} {answered:>8} {per_s:>7.2f} {per_s / best:>6.2f} "
            f"{sum(r['timeouts'] for r in runs[name]):>8} "
            f"{sum(r['opened'] for r in runs[name]):>6} {limits:>8}"
        )


if __name__ == "__main__":
    asyncio.run(main())
