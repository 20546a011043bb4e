"""Peak memory and time of one partition's cold load, by the load's batch sizes.

One run: Apache Kafka 4.1.1 (jars), one task partition whose results topic and task-state
changelog hold `--tasks` records each (bench/store_recovery.py's shapes, ~0.9 and
~0.6 KB). Then, for each variant, a fresh process loads the partition into a fresh
RocksDB with the task store's own `load_partition` (no worker around it: the figure is
the load's) and prints its time and peak RSS (VmHWM). Variants are `flush/fetch`:
records between two flushes of the load's progress, and records taken a fetch (0: all
that the consumer has). `--profile DIR`: each variant's load under cProfile, its statistics
in `DIR/<flush>-<fetch>.prof` (the time printed is then the profiled one).

    python bench/store_load.py [--tasks 1000000] [--variants 20000/0,5000/1000] [--profile DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from store_recovery import fill, peak_rss_mb

from streams.dev.brokers.apache import ApacheKafka
from streams.kafka.topics import ensure_topics
from streams.settings import load_settings
from streams.store import restore
from streams.store.local import LocalStore
from streams.store.taskstore import store_topics

TOPICS = ("tasks", "replay", "results", "dead_letters", "review")


async def load(config: dict[str, object], flush: int, fetch: int) -> None:
    """The child: one cold load with these batch sizes."""
    settings = load_settings(app_id=config["app"], topics=config["topics"],
                             kafka={"broker_url": config["url"], "partitions": 1})  # fmt: skip
    restore.LOAD_FLUSH_RECORDS = flush
    restore.LOAD_FETCH_RECORDS = fetch or None  # type: ignore[assignment]
    maps = LocalStore(Path(tempfile.mkdtemp(prefix="store-load-")), 64 << 20).open(0)
    started = time.monotonic()
    counts = await restore.load_partition(settings, store_topics(settings), 0, maps)
    print(json.dumps({"s": time.monotonic() - started, "rss_mb": peak_rss_mb(os.getpid()),
                      "records": sum((counts or {}).values())}))  # fmt: skip


async def main(tasks: int, variants: list[str], profile: Path | None) -> None:
    with ApacheKafka() as kafka:
        suffix = uuid.uuid4().hex[:6]
        url = f"kafka://{kafka.bootstrap}"
        settings = load_settings(
            app_id=f"load-{suffix}", kafka={"broker_url": url, "partitions": 1},
            topics={n: f"{n}-{suffix}" for n in TOPICS},
        )  # fmt: skip
        await ensure_topics(settings)
        await fill(settings, tasks)
        config = {"app": settings.app_id, "url": url,
                  "topics": settings.topics.model_dump(include=set(TOPICS))}  # fmt: skip
        print(f"{'flush / fetch':>16} {'load':>8} {'peak RSS':>10} {'records':>10}")
        for variant in variants:
            child = [sys.executable, __file__, "--child", json.dumps(config), variant]
            if profile is not None:
                profile.mkdir(parents=True, exist_ok=True)
                out_file = profile / f"{variant.replace('/', '-')}.prof"
                child[1:1] = ["-m", "cProfile", "-o", str(out_file)]
            out = subprocess.run(
                child,
                capture_output=True,
                text=True,
                check=True,
            )
            got = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{variant:>16} {got['s']:>7.1f}s {got['rss_mb']:>7.0f} MB {got['records']:>10,}",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        f, g = (int(x) for x in sys.argv[3].split("/"))
        asyncio.run(load(json.loads(sys.argv[2]), f, g))
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=1_000_000)
    parser.add_argument("--variants", default="20000/0,5000/0,5000/1000")
    parser.add_argument("--profile", type=Path, help="a folder for each load's cProfile")
    args = parser.parse_args()
    asyncio.run(main(args.tasks, args.variants.split(","), args.profile))
