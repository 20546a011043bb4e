"""What preprocessing, rendering and output validation cost per task, and their share
of the processor's CPU per task.

One run, one process, on the shipped sample comments (comment-analysis v1):

* clean + redact (`version.bind`), render (bind + Jinja + messages), and
  validate (`check_output` of a valid answer: schema, quoted evidence), each
  timed over every comment many times (CPU µs per task);
* the processor end to end (`processor.process`: decode, render, the guarded
  call through the OpenAI SDK, parse, validate, result record) against the LLM
  simulator in its own process, so the CPU measured is ours: CPU per task.

    python bench/pipeline_cost.py [--rounds 20] [--tasks 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import orjson

from streams.contract.records import Source
from streams.core.processor import ProcessorConfig, TaskProcessor
from streams.dev import sim_content
from streams.dev.brokers.common import free_port, wait_for_port
from streams.llm.openai_client import OpenAIClient
from streams.pipelines.output import check_output
from streams.pipelines.registry import PipelineRegistry
from streams.resilience.breaker import CircuitBreaker
from streams.resilience.guarded import GuardedClient
from streams.resilience.limiter import RateLimiter
from streams.resilience.retry import RetryPolicy

ROOT = Path(__file__).resolve().parents[1]


def cpu_us(fn: object, items: list[object], rounds: int) -> float:
    """CPU µs per call of fn(item), over every item `rounds` times."""
    start = time.process_time()
    for _ in range(rounds):
        for item in items:
            fn(item)  # type: ignore[operator]
    return (time.process_time() - start) / (rounds * len(items)) * 1e6


async def processor_cpu_ms(registry: PipelineRegistry, comments: list[dict[str, object]],
                           tasks: int) -> float:  # fmt: skip
    port = free_port()
    sim = subprocess.Popen([sys.executable, "-m", "streams.cli", "simulate-llm", "--port", str(port)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        wait_for_port("127.0.0.1", port, 30)
        client = OpenAIClient(base_url=f"http://127.0.0.1:{port}/v1", api_key="k",
                              connect_timeout_s=2, read_timeout_s=10)  # fmt: skip
        processor = TaskProcessor(
            registry, GuardedClient(client, limiter=RateLimiter(rpm=None), breaker=CircuitBreaker("sim")),
            ProcessorConfig(default_model="sim-1", policy=RetryPolicy(max_attempts=3),
                            deadline_s=60, max_task_bytes=10_000),
        )  # fmt: skip
        raws = [orjson.dumps({"task_id": f"c-{i}", "pipeline": "comment-analysis",
                              "input": comments[i % len(comments)]}) for i in range(tasks)]  # fmt: skip
        gate = asyncio.Semaphore(32)
        kinds: Counter[str] = Counter()

        async def one(i: int) -> None:
            async with gate:
                out = await processor.process(
                    raws[i], None, Source(topic="b", partition=0, offset=i)
                )
                kinds[out.kind] += 1

        await asyncio.gather(*(one(i) for i in range(min(200, tasks))))  # warm up
        start = time.process_time()
        await asyncio.gather(*(one(i) for i in range(tasks)))
        spent = time.process_time() - start
        await client.close()
        assert kinds["result"] == tasks + min(200, tasks), kinds
        return spent / tasks * 1000
    finally:
        sim.terminate()
        sim.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--tasks", type=int, default=2000)
    args = parser.parse_args()
    rows = (ROOT / "streams" / "samples" / "comments.jsonl").read_bytes().splitlines()
    comments = [orjson.loads(line) for line in rows if line.strip()]
    registry = PipelineRegistry.load(ROOT / "pipelines", ROOT / "schemas")
    pipeline = registry.get("comment-analysis")
    version = pipeline.version(None, "x")
    bound = [version.bind(c) for c in comments]
    answers = [(sim_content.analysis(v["text"]), v) for v in bound]  # as the model saw it
    assert all(check_output(a, pipeline, v) for a, v in answers)

    bind = cpu_us(version.bind, comments, args.rounds)  # type: ignore[arg-type]
    render = cpu_us(lambda c: version.render(c, "sim-1"), comments, args.rounds)  # type: ignore[arg-type]
    validate = cpu_us(lambda av: check_output(av[0], pipeline, av[1]), answers, args.rounds)  # type: ignore[index]
    per_task_ms = asyncio.run(processor_cpu_ms(registry, comments, args.tasks))
    ours = render + validate
    print(f"{len(comments)} sample comments x {args.rounds} rounds; processor: {args.tasks} tasks")
    print(f"{'clean + redact (bind)':<34} {bind:>8.1f} µs/task")
    print(f"{'render (bind + Jinja + messages)':<34} {render:>8.1f} µs/task")
    print(f"{'validate (schema + evidence)':<34} {validate:>8.1f} µs/task")
    print(f"{'processor end to end (CPU)':<34} {per_task_ms * 1000:>8.1f} µs/task")
    print(
        f"render + validate: {ours:.1f} µs = {ours / (per_task_ms * 1000):.1%} of the processor's CPU per task"
    )


if __name__ == "__main__":
    main()
