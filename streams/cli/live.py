"""`llm-streams status` without a task: a worker's `/status.json`, refreshing in the terminal."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from typing import Any

import orjson
from rich.console import Console
from rich.live import Live
from rich.table import Table


def fetch(url: str, timeout_s: float = 5.0) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        data: dict[str, Any] = orjson.loads(response.read())
        return data


def table(snap: dict[str, Any], url: str) -> Table:
    t = Table(title=f"llm-streams worker {url}", show_header=False)
    tasks = snap["tasks"]
    e2e = snap["end_to_end_s"]

    def seconds(v: float | None) -> str:
        return "–" if v is None else f"{v:.3f} s"

    per = snap["cost_per_result_usd"]
    per_result = f" (${per:.6f} per result)" if per else ""
    dead = snap["dead_letters_by_category"].items()
    rows = [
        ("tasks received / results / dead letters",
         f"{tasks['received']:.0f} / {tasks['results']:.0f} / {tasks['dead_letters']:.0f}"),
        ("in flight", f"{tasks['in_flight']:.0f}"),
        ("throughput", f"{snap['throughput_per_s']:.2f} tasks/s"),
        ("consumer lag", f"{snap['lag']:.0f} (paused partitions {snap['paused_partitions']:.0f})"),
        ("end-to-end p50 / p95 / p99", " / ".join(seconds(e2e[k]) for k in ("p50", "p95", "p99"))),
        ("cost so far", f"${snap['cost_usd']:.4f}" + per_result),
        ("breakers", ", ".join(f"{k}: {v}" for k, v in snap["breakers"].items()) or "–"),
        ("limiter", ", ".join(f"{k}: {v:.0f} RPM" for k, v in snap["limiter_rpm"].items()) or "–"),
        ("top dead letters", ", ".join(f"{k}: {v:.0f}" for k, v in dead) or "–"),
    ]  # fmt: skip
    for label, value in rows:
        t.add_row(label, value)
    return t


def watch(url: str, *, once: bool, every_s: float) -> int:
    console = Console()
    try:
        snap = fetch(url)
    except (urllib.error.URLError, OSError) as exc:
        console.print(f"cannot read {url}: {exc}", highlight=False)
        return 1
    if once:
        console.print(table(snap, url))
        return 0
    with Live(table(snap, url), console=console, refresh_per_second=4) as live:
        try:
            while True:
                time.sleep(every_s)
                try:
                    live.update(table(fetch(url), url))
                except (urllib.error.URLError, OSError) as exc:
                    live.update(Table(title=f"{url}: {exc}"))
        except KeyboardInterrupt:
            return 0


__all__ = ["fetch", "table", "watch"]
