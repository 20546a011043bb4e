"""Prompt packing: prompt tokens per task with and without packing, same labels.

On the shipped sample comments under 200 characters, the comment-analysis
pipeline as shipped vs the same pipeline with `packing: {max_items: N}`:

1. offline: prompt tokens per task as the o200k tokenizer counts the rendered
   requests (one request per task vs packs of N, in sample order);
2. on the LLM simulator (in process, through the real OpenAI SDK path): both
   processors answer every comment; printed are requests, prompt tokens per
   task as the simulator counted them, and how many outputs are identical.

    python bench/packing.py [--items 20]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path
from typing import Any

import orjson

from streams.contract.records import Source
from streams.core.packing import packed_messages
from streams.core.processor import ProcessorConfig, TaskProcessor
from streams.dev.simulator import SimConfig, SimulatorServer
from streams.llm.openai_client import OpenAIClient
from streams.llm.tokens import count_messages
from streams.pipelines.registry import PipelineRegistry
from streams.resilience.breaker import CircuitBreaker
from streams.resilience.guarded import GuardedClient
from streams.resilience.limiter import RateLimiter
from streams.resilience.retry import RetryPolicy

ROOT = Path(__file__).resolve().parents[1]


def registries(items: int, folder: Path) -> tuple[PipelineRegistry, PipelineRegistry]:
    spec = (ROOT / "pipelines" / "comment-analysis.yaml").read_text()
    packing = f"packing: {{slot: text, max_chars: 200, max_items: {items}, linger_s: 0.05}}\n"
    (folder / "comment-analysis.yaml").write_text(
        spec.replace("versions:\n", packing + "versions:\n", 1)
    )
    plain = PipelineRegistry.load(ROOT / "pipelines", ROOT / "schemas")
    return plain, PipelineRegistry.load(folder, ROOT / "schemas")


def offline(
    registry: PipelineRegistry, comments: list[dict[str, Any]], items: int
) -> tuple[float, float]:
    """Prompt tokens per task: one request each, and packs of `items`."""
    version = registry.get("comment-analysis").version(None, "x")
    prompts = [version.render(c, "gpt-4o-mini") for c in comments]
    alone = sum(count_messages(p.messages) for p in prompts) / len(prompts)
    packed = 0
    for start in range(0, len(prompts), items):
        group = prompts[start : start + items]
        messages = packed_messages(group[0].messages[0]["content"],
                                   [(f"task-{start + i:06d}", p.messages[1]["content"])
                                    for i, p in enumerate(group)])  # fmt: skip
        packed += count_messages(messages)
    return alone, packed / len(prompts)


async def on_simulator(
    registry: PipelineRegistry, comments: list[dict[str, Any]]
) -> tuple[list[Any], dict[str, Any]]:
    async with SimulatorServer(SimConfig()) as sim:
        client = OpenAIClient(
            base_url=sim.base_url, api_key="k", connect_timeout_s=2, read_timeout_s=10
        )
        processor = TaskProcessor(
            registry, GuardedClient(client, limiter=RateLimiter(rpm=None), breaker=CircuitBreaker("sim")),
            ProcessorConfig(default_model="gpt-4o-mini", deadline_s=60, max_task_bytes=10_000,
                            policy=RetryPolicy(max_attempts=3, backoff_base_s=0.01)),
        )  # fmt: skip
        raws = [orjson.dumps({"task_id": f"task-{i:06d}", "pipeline": "comment-analysis", "input": c})
                for i, c in enumerate(comments)]  # fmt: skip
        outcomes = await asyncio.gather(*(
            processor.process(raw, None, Source(topic="bench", partition=0, offset=i))
            for i, raw in enumerate(raws)
        ))  # fmt: skip
        await client.close()
        return [orjson.loads(o.value).get("output") for o in outcomes], sim.sim.snapshot()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=20)
    args = parser.parse_args()
    rows = [
        orjson.loads(line)
        for line in (ROOT / "streams" / "samples" / "comments.jsonl").read_bytes().splitlines()
        if line.strip()
    ]
    comments = [r for r in rows if len(r["text"]) < 200]
    with tempfile.TemporaryDirectory() as folder:
        plain, packed = registries(args.items, Path(folder))
        alone_tokens, packed_tokens = offline(plain, comments, args.items)
        plain_out, plain_stats = await on_simulator(plain, comments)
        packed_out, packed_stats = await on_simulator(packed, comments)
    same = sum(a == b and a is not None for a, b in zip(plain_out, packed_out, strict=True))
    labels = sum(a is not None and b is not None and a["sentiment"] == b["sentiment"]
                 for a, b in zip(plain_out, packed_out, strict=True))  # fmt: skip
    n = len(comments)
    print(f"{n} sample comments under 200 characters; packs of up to {args.items}")
    print(f"{'':<28} {'one per request':>16} {'packed':>10} {'packed / one':>13}")
    print(
        f"{'prompt tokens/task, offline':<28} {alone_tokens:>16.1f} {packed_tokens:>10.1f} {packed_tokens / alone_tokens:>13.2f}"
    )
    sim_alone = plain_stats["prompt_tokens"] / n
    sim_packed = packed_stats["prompt_tokens"] / n
    print(
        f"{'prompt tokens/task, simulator':<28} {sim_alone:>16.1f} {sim_packed:>10.1f} {sim_packed / sim_alone:>13.2f}"
    )
    print(f"{'requests':<28} {plain_stats['requests']:>16} {packed_stats['requests']:>10}")
    print(
        f"prompt tokens per task: {1 - packed_tokens / alone_tokens:.0%} fewer (offline), "
        f"{1 - sim_packed / sim_alone:.0%} fewer (simulator)"
    )
    print(f"same output: {same}/{n}; same sentiment label: {labels}/{n}")


if __name__ == "__main__":
    asyncio.run(main())
