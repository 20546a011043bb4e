"""`llm-streams replay`: progress bar with ETA, cost estimate, summary."""

from __future__ import annotations

import asyncio
from datetime import datetime

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from streams.cli.base import load_pipelines
from streams.errors import ConfigError, TaskError
from streams.kafka.security import preflight
from streams.ops.replay import Checkpoint, Replayer, ReplayRequest
from streams.settings import Settings


def run_replay_command(
    settings: Settings,
    *,
    source: str,
    since: datetime | None,
    until: datetime | None,
    from_offsets: dict[int, int],
    pipeline: str | None,
    prompt_version: str | None,
    force: bool,
    dry_run: bool,
    tier: str | None = None,
    budget_usd: float | None = None,
) -> int:
    console = Console(stderr=True, markup=False)  # what went wrong is text, not markup
    request = ReplayRequest(
        source=source, since=since, until=until, from_offsets=from_offsets,
        pipeline=pipeline, prompt_version=prompt_version, force=force, tier=tier,
        budget_usd=budget_usd,
    )  # fmt: skip
    try:
        replayer = Replayer(settings, request, load_pipelines(settings))
    except (ConfigError, TaskError) as exc:
        console.print(f"replay: {exc}", highlight=False)
        return 2
    columns = (
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("sent {task.fields[sent]} · skipped {task.fields[skipped]} · "
                   "est. ${task.fields[cost]:.4f}"),
        TimeElapsedColumn(), TimeRemainingColumn(),
    )  # fmt: skip
    with Progress(*columns, console=console, transient=False) as progress:
        bar = progress.add_task(
            "estimating" if dry_run else "replaying", total=None, sent=0, skipped=0, cost=0.0
        )

        def show(cp: Checkpoint) -> None:
            c = cp.counts
            progress.update(bar, total=cp.total, completed=cp.progressed, sent=c.published,
                            skipped=c.answered + c.filtered + c.invalid,
                            cost=c.cost_usd(settings, tier or "sync"))  # fmt: skip

        async def checked() -> Checkpoint:
            await preflight(settings)
            return await replayer.run(dry_run=dry_run, on_progress=show)

        try:
            cp = asyncio.run(checked())
        except ConfigError as exc:
            progress.stop()
            console.print(f"replay: {exc}", highlight=False)
            return 2
    _summary(settings, replayer, cp, dry_run=dry_run, tier=tier)
    return 0


def _summary(
    settings: Settings, replayer: Replayer, cp: Checkpoint, *, dry_run: bool, tier: str | None
) -> None:
    """What the replay read, sent and skipped, and what it is estimated to cost per lane:
    one line per fact, for people and scripts."""
    c = cp.counts
    verb = "would send" if dry_run else "sent"
    out = Console(soft_wrap=True, markup=False)
    out.print(
        f"replay {cp.replay_id} of {cp.source}: {c.read} record(s) read, {verb} {c.published} "
        f"to {settings.topics.replay}; skipped {c.answered} already answered"
        + (f" ({c.stale} of them by an earlier definition of their version, edited in place "
           "since: --force asks them again, or name the edit as a new version)"
           if c.stale else "")
        + f", {c.filtered} of other pipelines, {c.invalid} invalid"
        + (f", {c.erased} erased since" if c.erased else "")
        + (f", {c.refused} refused for good by the topic or the producer (the log names "
           f"them: too large, invalid or not authorised)" if c.refused else ""),
        highlight=False,
    )  # fmt: skip
    out.print(
        f"estimated cost ${c.cost_usd(settings):.4f} ({c.prompt_tokens} prompt tokens counted, "
        f"~{c.completion_tokens:.0f} completion tokens estimated)",
        highlight=False,
    )
    batch = c.cost_usd(settings, "batch")
    chosen = tier or "each pipeline's lane policy"
    out.print(
        f"estimated cost per lane: sync ${c.cost_usd(settings):.4f} · flex ${batch:.4f} · "
        f"batch ${batch:.4f} (batch price {settings.batch_api.price_ratio:g} of sync; "
        f"this replay: {chosen})",
        highlight=False,
    )
    budget = replayer.request.budget_usd
    if budget is not None:
        what = f"estimated cost of what was {verb.split()[-1]}: ${c.estimated_usd:.4f}"
        out.print(f"{what} (each task at its lane's price; budget ${budget:.4f})",
                  highlight=False)  # fmt: skip
    if cp.at_budget:
        left = cp.total - cp.progressed
        out.print(f"stopped at the budget: {left} record(s) of the range not read yet; run the "
                  "same command with a higher --budget-usd to go on", highlight=False)  # fmt: skip
    if replayer.finished_before:
        out.print(f"(replay {cp.replay_id} had finished before; nothing sent now)", highlight=False)
    elif replayer.resumed_at:
        out.print(f"(resumed from its checkpoint at {replayer.resumed_at})", highlight=False)
