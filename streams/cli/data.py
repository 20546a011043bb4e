"""Commands over the topics: publish, tail, a worker's or a task's status, redrive, replay,
backtrack, diff."""

from __future__ import annotations

import sys
from typing import Any

import click

# Above this divergence (PSI or KS) a field is said to drift: the alert rule's threshold
from streams.cli.base import (
    cli,
    iso_time_or_exit,
    on_kafka,
    pipeline_or_exit,
    registry_or_exit,
    settings_or_exit,
)
from streams.errors import REDRIVABLE, ConfigError


@cli.command()
@click.argument("source", type=click.File("rb"))
@click.option(
    "--pipeline",
    default="comment-analysis",
    show_default=True,
    help="Pipeline for lines that do not name one.",
)
@click.option("--topic", default=None, help="Target topic (default: the tasks topic).")
def publish(source: Any, pipeline: str, topic: str | None) -> None:
    """Publish tasks from a JSON-lines FILE (or - for stdin).

    A line is a task, or just its `input` object; task_id is generated when absent.
    """
    from streams.cli.commands import publish_lines

    settings = settings_or_exit()
    sent, bad, refused = on_kafka(settings, publish_lines(settings, source, pipeline=pipeline,
                                                         topic=topic))  # fmt: skip
    click.echo(f"published {sent} task(s); {bad} invalid line(s) skipped", err=True)
    if refused:
        click.echo(f"publish: {refused}; the log says why", err=True)
    if bad or refused:
        sys.exit(1)


@cli.command()
@click.option("--task-id", "task_ids", multiple=True, required=True, help="A task to erase.")
@click.option("--pipeline", required=True, help="The pipeline the tasks belong to.")
@click.option("--source-key", default=None,
              help="The source record's key, for a sink keyed by it (one task only).")  # fmt: skip
@click.option("--source-key-base64", default=None,
              help="The same, for a key that is not UTF-8: its bytes in base64 (its task id "
                   "reads `base64:` and them).")  # fmt: skip
@click.option("--session-id", default=None,
              help="The tasks' session, for a pipeline keeping sessions.")  # fmt: skip
def erase(
    task_ids: tuple[str, ...],
    pipeline: str,
    source_key: str | None,
    source_key_base64: str | None,
    session_id: str | None,
) -> None:
    """Erase tasks' answers for a deletion request: their results (every prompt version's),
    dead letters, states, review copies and sink records get tombstones. The workers that
    own their partitions write them; compaction removes the data later, on the topics'
    schedule."""
    import base64
    import binascii

    from streams.kafka.publisher import TaskPublisher
    from streams.pipelines.sources import RAW_KEY_PREFIX

    if source_key_base64 is not None:
        if source_key is not None:
            raise click.UsageError("give --source-key or --source-key-base64, not both")
        try:
            base64.b64decode(source_key_base64, validate=True)
        except binascii.Error as exc:
            raise click.UsageError(f"--source-key-base64 is not base64: {exc}") from None
        source_key = RAW_KEY_PREFIX + source_key_base64  # its text, as the worker reads it
    if source_key is not None and len(task_ids) > 1:
        raise click.UsageError("--source-key names one task's source record: give one --task-id")
    settings = settings_or_exit()
    pipeline_or_exit(settings, pipeline, "erase")

    async def send() -> None:
        async with TaskPublisher(settings) as publisher:
            for task_id in task_ids:
                await publisher.erase(task_id, pipeline, source_key, session_id=session_id,
                                      source_key_base64=source_key_base64)  # fmt: skip

    on_kafka(settings, send())
    click.echo(f"asked to erase {len(task_ids)} task(s) of {pipeline}", err=True)


@cli.command()
@click.argument("topic")
@click.option("--from-beginning", is_flag=True, help="Start at the earliest offset.")
@click.option("--max", "max_records", type=int, default=0, help="Stop after N records.")
@click.option("--idle-timeout", type=float, default=0.0, help="Stop after N s without records.")
def tail(topic: str, from_beginning: bool, max_records: int, idle_timeout: float) -> None:
    """Pretty-print records of TOPIC as they arrive."""
    from streams.cli.commands import tail_topic

    settings = settings_or_exit()
    on_kafka(settings, tail_topic(settings, topic, from_beginning, max_records, idle_timeout))


@cli.command()
@click.argument("task_id", required=False)
@click.option("--url", default=None, help="A worker's status (default: this host's web port).")
@click.option("--once", is_flag=True, help="Print the worker's status once and exit.")
@click.option("--every", default=2.0, show_default=True, help="Refresh period (s).")
def status(task_id: str | None, url: str | None, once: bool, every: float) -> None:
    """A task's state and history (TASK_ID), or a worker's live status (no TASK_ID):
    throughput, lag, breaker, limiter, p50/p95/p99, cost so far, top dead letters."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    from streams.ops.redrive import task_state

    settings = settings_or_exit()
    if task_id is None:
        from streams.cli.live import watch

        target = url or f"http://127.0.0.1:{settings.web_port}/status.json"
        sys.exit(watch(target, once=once, every_s=every))
    state = on_kafka(settings, task_state(settings, task_id))
    if state is None:
        click.echo(f"no state for task {task_id!r}", err=True)
        sys.exit(1)
    console = Console()
    if not console.is_terminal:  # piped: no 80-column wrap of keys and notes
        console = Console(width=200)
    # The state as stored, read as text: no markup (a provider's error saying
    # "[/v1/chat/completions]" was a MarkupError), any shape another version wrote.
    history = state.pop("history", [])
    for key, value in state.items():
        console.print(f"[bold]{escape(str(key)):<17}[/bold] {escape(str(value))}",
                      highlight=False)  # fmt: skip
    table = Table("at", "status", "prompt version", "result key", "note")
    for h in history if isinstance(history, list) else []:
        if isinstance(h, dict):
            table.add_row(*(Text(str(h.get(name) or "")) for name in
                            ("at", "status", "prompt_version", "result_key", "note")))  # fmt: skip
    console.print(table)


@cli.command()
@click.option(
    "--category",
    "categories",
    multiple=True,
    required=True,
    type=click.Choice([category.value for category in REDRIVABLE]),
    help="Retryable categories to re-queue (repeat the option for several).",
)
@click.option("--since", default=None, help="Only dead letters since this ISO time (UTC).")
@click.option("--dry-run", is_flag=True, help="Print what would be re-queued.")
def redrive(categories: tuple[str, ...], since: str | None, dry_run: bool) -> None:
    """Re-queue dead letters of retryable categories once their cause is gone.

    Each keeps its task_id and lands as a normal result; a task answered since, or
    already re-queued, is skipped.
    """
    from streams.ops.redrive import redrive as run_redrive

    settings = settings_or_exit()
    when = iso_time_or_exit("--since", since)
    plan = on_kafka(settings, run_redrive(settings, set(categories), when, dry_run))
    verb = "would re-queue" if dry_run else "re-queued"
    if plan.refused:
        click.echo(f"redrive: {plan.refused}; the log says why", err=True)
    click.echo(
        f"{verb} {len(plan.requeue) if dry_run else plan.sent} task(s); skipped: "
        f"{plan.skipped_category} other category, "
        f"{plan.skipped_answered} answered or re-queued since, {plan.skipped_before} before "
        f"--since, {plan.skipped_not_a_task} not a task"
    )


@cli.command()
@click.option("--source", default=None, help="Topic to replay (default: the tasks topic).")
@click.option("--from", "since", default=None, help="Replay records from this ISO time.")
@click.option("--to", "until", default=None, help="... up to this ISO time (default: now).")
@click.option(
    "--from-offset", "from_offsets", multiple=True, metavar="P:O",
    help="Start partition P at offset O (repeatable; other partitions start at --from).",
)  # fmt: skip
@click.option("--pipeline", default=None, help="Only tasks of this pipeline.")
@click.option("--prompt-version", default=None, help="Answer under this version (new keys).")
@click.option("--force", is_flag=True, help="Ask the LLM again even for answered tasks.")
@click.option("--dry-run", is_flag=True, help="Print the plan and cost estimate only.")
@click.option(
    "--lane", "tier", type=click.Choice(["sync", "flex", "batch"]), default=None,
    help="How the worker answers: sync calls, flex (batch price, slower), or the Batch API "
    "(batch price, within 24 h). Default: each pipeline's lane policy.",
)  # fmt: skip
@click.option(
    "--budget-usd", type=click.FloatRange(min=0, min_open=True), default=None,
    help="What the whole run may cost, estimated before each task is sent (its prompt "
    "counted, its answer as long as the version's answers so far): the replay stops before "
    "the task that would pass it. Run it again with a higher budget to go on.",
)  # fmt: skip
def replay(
    source: str | None, since: str | None, until: str | None, from_offsets: tuple[str, ...],
    pipeline: str | None, prompt_version: str | None, force: bool, dry_run: bool,
    tier: str | None, budget_usd: float | None,
) -> None:  # fmt: skip
    """Re-run a historical range of a task topic through the replay lane.

    Tasks already answered under the same result key are skipped (a new prompt
    version gives new keys). Run the same command again to resume a killed replay.
    """
    from streams.cli.replay import run_replay_command

    settings = settings_or_exit()
    offsets: dict[int, int] = {}
    for spec in from_offsets:
        p, _, o = spec.partition(":")
        if not (f"{p}{o}".isascii() and p.isdigit() and o.isdigit()):
            click.echo(f"--from-offset: expected PARTITION:OFFSET, got {spec!r}", err=True)
            sys.exit(2)
        offsets[int(p)] = int(o)
    start = iso_time_or_exit("--from", since)
    if start is None and not offsets:
        click.echo("replay: give --from TIME or --from-offset P:O", err=True)
        sys.exit(2)
    sys.exit(run_replay_command(
        settings, source=source or settings.topics.tasks, since=start,
        until=iso_time_or_exit("--to", until), from_offsets=offsets, pipeline=pipeline,
        prompt_version=prompt_version, force=force, dry_run=dry_run, tier=tier,
        budget_usd=budget_usd,
    ))  # fmt: skip


@cli.command()
@click.argument("task_ids", nargs=-1)
@click.option("--pipeline", default=None, help="Only tasks of this pipeline.")
@click.option("--version", "current", default=None, help="Only tasks now answered under this.")
@click.option("--since", default=None, help="Only tasks whose state changed since this ISO time.")
@click.option("--until", default=None, help="... and before this ISO time.")
@click.option(
    "--restore",
    "restore_version",
    default=None,
    metavar="VERSION",
    help="Restore the result this prompt version gave (no LLM call).",
)
@click.option("--rerun", is_flag=True, help="Answer again with the LLM (under --as-version).")
@click.option("--as-version", default=None, help="With --rerun: the version to answer under.")
@click.option("--dry-run", is_flag=True, help="Print what would be sent.")
def backtrack(
    task_ids: tuple[str, ...], pipeline: str | None, current: str | None, since: str | None,
    until: str | None, restore_version: str | None, rerun: bool, as_version: str | None,
    dry_run: bool,
) -> None:  # fmt: skip
    """Put tasks back to an earlier prompt version's result, or answer them again.

    Select by TASK_IDS and/or --pipeline/--version/--since/--until. The worker
    applies it in order with the task's other records and notes it in the
    task's history (`llm-streams status TASK_ID`).
    """
    from streams.ops.backtrack import Selection
    from streams.ops.backtrack import backtrack as run_backtrack

    if bool(restore_version) == rerun:
        click.echo("backtrack: give exactly one of --restore VERSION or --rerun", err=True)
        sys.exit(2)
    settings = settings_or_exit()
    selection = Selection(task_ids=frozenset(task_ids), pipeline=pipeline, prompt_version=current,
                          since=iso_time_or_exit("--since", since),
                          until=iso_time_or_exit("--until", until))  # fmt: skip
    action: Any = "restore" if restore_version else "rerun"
    registry = registry_or_exit(settings, "backtrack", 2)
    try:
        plan = on_kafka(
            settings,
            run_backtrack(
                settings,
                registry,
                selection,
                action,
                restore_version or as_version,
                dry_run=dry_run,
            ),
        )
    except ConfigError as exc:
        click.echo(f"backtrack: {exc}", err=True)
        sys.exit(2)
    verb = "would send" if dry_run else "sent"
    click.echo(f"{verb} {plan.sent} task(s) to {action}")
    if plan.refused:
        click.echo(f"backtrack: {plan.refused}; the log says why", err=True)
    if plan.done:
        click.echo(f"skipped {len(plan.done)} this backtrack already put back, unchanged since: "
                   f"{', '.join(plan.done[:10])}")  # fmt: skip
    if plan.no_result:
        click.echo(f"skipped {len(plan.no_result)} never answered under {restore_version}: "
                   f"{', '.join(plan.no_result[:10])}")  # fmt: skip
    if plan.no_source:
        click.echo(f"skipped {len(plan.no_source)} whose last record is gone or unreadable: "
                   f"{', '.join(plan.no_source[:10])}")  # fmt: skip
    if plan.missing_ids:
        click.echo(f"no state for {len(plan.missing_ids)}: {', '.join(plan.missing_ids[:10])}")
    if plan.no_version:
        click.echo(f"skipped {len(plan.no_version)} ({plan.version_refused}): "
                   f"{', '.join(plan.no_version[:10])}", err=not plan.sent)  # fmt: skip
        if not plan.sent:
            sys.exit(2)


@cli.command()
@click.option("--pipeline", required=True, help="Pipeline whose results to compare.")
@click.option("--from-version", required=True, help="The earlier prompt version.")
@click.option("--to-version", required=True, help="The later prompt version.")
def diff(pipeline: str, from_version: str, to_version: str) -> None:
    """Summarise how outputs changed between two versions (tasks answered under both)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from streams.ops.diff import compare

    settings = settings_or_exit()
    schema = pipeline_or_exit(settings, pipeline, "diff").output_schema
    compared = on_kafka(settings, compare(settings, pipeline, from_version, to_version, schema))
    console = Console(soft_wrap=True, markup=False)  # names and labels are text, not markup
    console.print(f"{pipeline}: {compared.both} task(s) answered under both {from_version} and "
                  f"{to_version}; {compared.only_from} only under {from_version}, "
                  f"{compared.only_to} only under {to_version}", highlight=False)  # fmt: skip
    if not compared.both:
        return
    table = Table("field", "changed", "details")
    for d in compared.fields:
        if d.kind == "label":
            flips = ", ".join(f"{a}→{b} {n}" for (a, b), n in d.flips.most_common(5))
            detail = f"flips: {flips or 'none'}"
        elif d.kind == "number":
            detail = f"mean shift {d.mean_shift:+.3f}, mean |shift| {d.mean_abs_shift:.3f}"
        elif d.kind == "list":
            detail = f"mean Jaccard similarity {d.mean_jaccard:.2f}"
        else:
            detail = ""
        table.add_row(Text(d.name), f"{d.changed_share:.1%} of {d.compared}", Text(detail))
    console.print(table)
