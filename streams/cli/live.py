"""`llm-streams status` without a task: a worker's `/status.json`, refreshing in the terminal."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from typing import Any

import orjson
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text


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
    who = snap.get("worker") or {}
    llm = snap.get("llm") or {}
    rows = [
        ("worker", " · ".join(str(x) for x in (
            who.get("host"), who.get("app_id"), who.get("version"),
            f"up {who['uptime_s']:.0f} s" if "uptime_s" in who else None,
            "partitions " + (",".join(map(str, who["partitions"])) or "none")
            if "partitions" in who else None, who.get("model"), who.get("endpoint"))
            if x) or "–"),
        ("tasks received / results / dead letters",
         f"{tasks['received']:.0f} / {tasks['results']:.0f} / {tasks['dead_letters']:.0f}"),
        ("in flight", f"{tasks['in_flight']:.0f}"),
        ("throughput", f"{snap['throughput_per_s']:.2f} tasks/s"),
        ("consumer lag", f"{snap['lag']:.0f} (paused partitions {snap['paused_partitions']:.0f})"),
        ("end-to-end p50 / p95 / p99", " / ".join(seconds(e2e[k]) for k in ("p50", "p95", "p99"))),
        ("cost so far", f"${snap['cost_usd']:.4f}" + per_result),
        ("breakers", ", ".join(f"{k}: {v}" for k, v in snap["breakers"].items()) or "–"),
        ("limiter", ", ".join(f"{k}: {v:.0f} RPM" for k, v in snap["limiter_rpm"].items()) or "–"),
        ("deployments", "; ".join(
            f"{d['deployment']}: {d['breaker']}, {d['rpm']:.0f} RPM, {d['ok']} ok / "
            f"{d['throttled']} 429 / {d['errors']} errors, ${d['cost_usd']:.4f}"
            for d in snap.get("deployments", [])) or "–"),
        ("llm calls since start", (
            f"{llm['ok']} ok / {llm['rate_limited']} 429; errors "
            + (", ".join(f"{k}: {v}" for k, v in llm["errors"].items()) or "none")
            + "; retries " + (", ".join(f"{k}: {v}" for k, v in llm["retries"].items())
                              or "none")) if llm else "–"),
        ("top dead letters", ", ".join(f"{k}: {v:.0f}" for k, v in dead) or "–"),
        ("spend caps", ", ".join(
            f"{b['pipeline']} {b['lane']}/{b['window']}: ${b['spent_usd']:.4f} of "
            f"${b['cap_usd']:.4f}" + (f" ({b['waiting']} waiting)" if b["waiting"] else "")
            for b in snap.get("budgets", [])) or "–"),
    ]  # fmt: skip
    for label, value in rows:
        t.add_row(label, Text(value))  # as text: an endpoint's or model's name is no markup
    return t


def versions_table(snap: dict[str, Any]) -> Table | None:
    """Per prompt version: content pass rate, repairs, latency, cost per answered task."""
    versions = snap.get("versions") or []
    if not versions:
        return None
    t = Table("pipeline / version", "tasks", "pass", "repaired", "dead letters", "review",
              "p50 / p95", "tokens / answer", "cost / answer", title="prompt versions")  # fmt: skip

    def pct(x: float | None) -> str:
        return "–" if x is None else f"{x:.1%}"

    def secs(x: float | None) -> str:
        return "–" if x is None else f"{x:.2f}s"

    for v in versions:
        lat = v["latency_s"]
        tokens, cost = v["tokens_per_accepted"], v["cost_per_accepted_usd"]
        t.add_row(
            Text(f"{v['pipeline']} / {v['version']}"), str(v["tasks"]), pct(v["pass_rate"]),
            pct(v["repair_rate"]), pct(v["dead_letter_rate"]), pct(v["review_share"]),
            f"{secs(lat['p50'])} / {secs(lat['p95'])}",
            "–" if tokens is None else f"{tokens:.0f}",
            "–" if cost is None else f"${cost:.6f}",
        )  # fmt: skip
    return t


def view(snap: dict[str, Any], url: str) -> Group:
    """The worker table, and the versions table under it when there are versions."""
    versions = versions_table(snap)
    return Group(table(snap, url), *([versions] if versions is not None else []))


class Unreadable(Exception):
    """The worker's status could not be read, or is none this version can show."""


def shown(url: str) -> Group:
    """The view of the worker's status at `url`; Unreadable saying why it is none: no
    answer, an answer that is not JSON (another service at that port), or a status of a
    shape this version does not know (a worker of another version)."""
    try:
        snap = fetch(url)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise Unreadable(f"cannot read {url}: {exc}") from exc
    try:
        return view(snap, url)
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise Unreadable(f"{url} answered no status this version can show ({exc!r}): "
                         "a worker of another version, or not a worker?") from exc  # fmt: skip


def watch(url: str, *, once: bool, every_s: float) -> int:
    console = Console()
    try:
        first = shown(url)
    except Unreadable as exc:
        console.print(str(exc), highlight=False, markup=False)
        return 1
    if once:
        console.print(first)
        return 0
    with Live(first, console=console, refresh_per_second=4) as live:
        try:
            while True:
                time.sleep(every_s)
                try:
                    live.update(shown(url))
                except Unreadable as exc:
                    live.update(Table(title=Text(str(exc))))
        except KeyboardInterrupt:
            return 0


__all__ = ["Unreadable", "fetch", "shown", "table", "versions_table", "view", "watch"]
