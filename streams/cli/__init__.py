"""The `llm-streams` command line."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import click

from streams.contract.evaluation import PromotionGuard
from streams.errors import REDRIVABLE, ConfigError
from streams.settings import Settings, load_settings

# Above this divergence (PSI or KS) a field is said to drift: the alert rule's threshold
# (deploy/prometheus/rules.yml, LLMStreamsOutputDrift).
DRIFT_THRESHOLD = 0.15


def settings_or_exit(**overrides: Any) -> Settings:
    """Settings, or a one-line message naming the bad variable and exit status 2."""
    try:
        return load_settings(**overrides)
    except ConfigError as exc:
        click.echo(f"llm-streams: {exc}", err=True)
        sys.exit(2)


def iso_time_or_exit(option: str, value: str | None) -> datetime | None:
    """An ISO 8601 time (UTC when it names no zone), or a message and exit status 2."""
    if not value:
        return None
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        click.echo(f"{option}: not an ISO time: {value!r}", err=True)
        sys.exit(2)
    return when if when.tzinfo else when.replace(tzinfo=UTC)


T = TypeVar("T")


def on_kafka(settings: Settings, work: Coroutine[Any, Any, T]) -> T:
    """Run a command's Kafka work after the connection check (`kafka.security.preflight`):
    a wrong broker address, credential or certificate is one line naming the setting,
    exit status 2, not a traceback after the client's retries."""
    from streams.kafka.security import preflight

    async def checked() -> T:
        await preflight(settings)
        return await work

    from aiokafka.errors import (
        ClusterAuthorizationFailedError,
        GroupAuthorizationFailedError,
        KafkaError,
        TopicAuthorizationFailedError,
        TransactionalIdAuthorizationFailed,
    )

    denied = (TopicAuthorizationFailedError, GroupAuthorizationFailedError,
              ClusterAuthorizationFailedError, TransactionalIdAuthorizationFailed)  # fmt: skip

    try:
        return asyncio.run(checked())
    except ConfigError as exc:
        work.close()
        click.echo(f"llm-streams: {exc}", err=True)
        sys.exit(2)
    except denied as exc:  # an ACL the command needs is missing
        click.echo(f"llm-streams: Kafka: not authorized: {exc!r}; grant the ACLs "
                   "`llm-streams acls` lists for this command", err=True)  # fmt: skip
        sys.exit(2)
    except KafkaError as exc:  # the broker refused the command's work: one line, no traceback
        click.echo(f"llm-streams: Kafka refused it: {exc!r}", err=True)
        sys.exit(1)


@click.group()
@click.version_option(package_name="llm-streams")
def cli() -> None:
    """Run LLM work on every record of a Kafka topic."""


@cli.command()
def worker() -> None:
    """Run a worker (Faust) with the settings from the environment."""
    from streams.worker.run import run_worker

    try:
        run_worker(settings_or_exit())
    except ConfigError as exc:  # the broker's topics or features do not fit the settings
        click.echo(f"llm-streams: {exc}", err=True)
        sys.exit(2)


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
    sent, bad = on_kafka(settings, publish_lines(settings, source, pipeline=pipeline, topic=topic))
    click.echo(f"published {sent} task(s); {bad} invalid line(s) skipped", err=True)
    if bad:
        sys.exit(1)


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


@cli.command("simulate-llm")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--latency-ms", type=float, default=0.0, show_default=True)
@click.option("--jitter-ms", type=float, default=0.0, show_default=True)
@click.option(
    "--latency-dist",
    type=click.Choice(["fixed", "uniform", "normal", "lognormal"]),
    default="uniform",
    show_default=True,
)
@click.option("--max-concurrency", type=int, default=0, help="0 = unlimited.")
@click.option("--rpm", type=int, default=0, help="Requests per minute limit (0 = none).")
@click.option("--tpm", type=int, default=0, help="Tokens per minute limit (0 = none).")
@click.option(
    "--burst-s",
    type=float,
    default=1.0,
    show_default=True,
    help="Seconds of limit a burst may use (sub-minute enforcement).",
)
@click.option("--error-500-rate", type=float, default=0.0)
@click.option("--error-503-rate", type=float, default=0.0)
@click.option("--hang-rate", type=float, default=0.0)
@click.option("--hang-s", type=float, default=600.0)
@click.option("--malformed-rate", type=float, default=0.0)
@click.option("--context-window", type=int, default=128_000)
@click.option("--api-key", default=None, help="Require this bearer key.")
@click.option("--seed", type=int, default=0)
def simulate_llm(host: str, port: int, jitter_ms: float, **knobs: Any) -> None:
    """Serve the OpenAI-compatible LLM simulator."""
    from streams.dev.simulator import SimConfig, serve

    config = SimConfig(latency_jitter_ms=jitter_ms, **knobs)
    click.echo(f"LLM simulator on http://{host}:{port}/v1", err=True)
    serve(config, host, port)


@cli.command()
@click.option("--count", type=int, default=0, help="Sample comments to publish (0 = all).")
@click.option("--timeout", type=float, default=120.0, show_default=True)
@click.option("--quiet", is_flag=True, help="Only the summary.")
@click.option(
    "--external",
    is_flag=True,
    help="Use the Kafka the settings name (LLM_STREAMS_KAFKA__BROKER_URL and its "
    "__SECURITY__* settings) instead of the embedded broker; topics of its own.",
)
def demo(count: int, timeout: float, quiet: bool, external: bool) -> None:
    """Embedded broker + simulator (or your endpoint) + worker + sample comments, live."""
    from streams.dev.demo import run_demo

    try:
        sys.exit(run_demo(count=count, timeout_s=timeout, quiet=quiet, external=external))
    except ConfigError as exc:
        click.echo(f"llm-streams: {exc}", err=True)
        sys.exit(2)


@cli.command()
@click.argument("task_id", required=False)
@click.option("--url", default=None, help="A worker's status (default: this host's web port).")
@click.option("--once", is_flag=True, help="Print the worker's status once and exit.")
@click.option("--every", default=2.0, show_default=True, help="Refresh period (s).")
def status(task_id: str | None, url: str | None, once: bool, every: float) -> None:
    """A task's state and history (TASK_ID), or a worker's live status (no TASK_ID):
    throughput, lag, breaker, limiter, p50/p95/p99, cost so far, top dead letters."""
    from rich.console import Console
    from rich.table import Table

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
    history = state.pop("history", [])
    for key, value in state.items():
        console.print(f"[bold]{key:<17}[/bold] {value}", highlight=False)
    table = Table("at", "status", "prompt version", "result key", "note")
    for h in history:
        table.add_row(h["at"], h["status"], h.get("prompt_version") or "",
                      h.get("result_key") or "", h.get("note") or "")  # fmt: skip
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
    click.echo(
        f"{verb} {len(plan.requeue)} task(s); skipped: {plan.skipped_category} other category, "
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
def replay(
    source: str | None, since: str | None, until: str | None, from_offsets: tuple[str, ...],
    pipeline: str | None, prompt_version: str | None, force: bool, dry_run: bool,
    tier: str | None,
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
        if not (p.isdigit() and o.isdigit()):
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
    from streams.ops.backtrack import Selection, plan_backtrack, send_backtrack
    from streams.pipelines.registry import PipelineRegistry

    if bool(restore_version) == rerun:
        click.echo("backtrack: give exactly one of --restore VERSION or --rerun", err=True)
        sys.exit(2)
    settings = settings_or_exit()
    selection = Selection(task_ids=frozenset(task_ids), pipeline=pipeline, prompt_version=current,
                          since=iso_time_or_exit("--since", since),
                          until=iso_time_or_exit("--until", until))  # fmt: skip
    action: Any = "restore" if restore_version else "rerun"
    try:
        registry = PipelineRegistry.load(settings.pipelines_dir, settings.schemas_dir)
        plan = on_kafka(settings, plan_backtrack(settings, registry, selection, action,
                                          restore_version or as_version))  # fmt: skip
    except ConfigError as exc:
        click.echo(f"backtrack: {exc}", err=True)
        sys.exit(2)
    sent = 0 if dry_run else on_kafka(settings, send_backtrack(settings, plan, action))
    verb = "would send" if dry_run else "sent"
    click.echo(f"{verb} {len(plan.send) if dry_run else sent} task(s) to {action}")
    if plan.no_result:
        click.echo(f"skipped {len(plan.no_result)} never answered under {restore_version}: "
                   f"{', '.join(plan.no_result[:10])}")  # fmt: skip
    if plan.no_source:
        click.echo(f"skipped {len(plan.no_source)} whose last record is gone or unreadable: "
                   f"{', '.join(plan.no_source[:10])}")  # fmt: skip
    if plan.missing_ids:
        click.echo(f"no state for {len(plan.missing_ids)}: {', '.join(plan.missing_ids[:10])}")


@cli.command()
@click.option("--pipeline", required=True, help="Pipeline whose results to compare.")
@click.option("--from-version", required=True, help="The earlier prompt version.")
@click.option("--to-version", required=True, help="The later prompt version.")
def diff(pipeline: str, from_version: str, to_version: str) -> None:
    """Summarise how outputs changed between two versions (tasks answered under both)."""
    from rich.console import Console
    from rich.table import Table

    from streams.errors import TaskError
    from streams.ops.diff import summarise, version_pairs
    from streams.pipelines.registry import PipelineRegistry

    settings = settings_or_exit()
    try:
        registry = PipelineRegistry.load(settings.pipelines_dir, settings.schemas_dir)
        schema = registry.get(pipeline).output_schema
    except (ConfigError, TaskError) as exc:
        click.echo(f"diff: {exc}", err=True)
        sys.exit(2)
    pairs, only_from, only_to = on_kafka(
        settings, version_pairs(settings, pipeline, from_version, to_version)
    )
    console = Console(soft_wrap=True)
    console.print(f"{pipeline}: {len(pairs)} task(s) answered under both {from_version} and "
                  f"{to_version}; {only_from} only under {from_version}, {only_to} only under "
                  f"{to_version}", highlight=False)  # fmt: skip
    if not pairs:
        return
    table = Table("field", "changed", "details")
    for d in summarise(pairs, schema):
        if d.kind == "label":
            flips = ", ".join(f"{a}→{b} {n}" for (a, b), n in d.flips.most_common(5))
            detail = f"flips: {flips or 'none'}"
        elif d.kind == "number":
            detail = f"mean shift {d.mean_shift:+.3f}, mean |shift| {d.mean_abs_shift:.3f}"
        elif d.kind == "list":
            detail = f"mean Jaccard similarity {d.mean_jaccard:.2f}"
        else:
            detail = ""
        table.add_row(d.name, f"{d.changed_share:.1%} of {d.compared}", detail)
    console.print(table)


@cli.group()
def ab() -> None:
    """A/B decisions on prompt versions: compare them, promote one."""


def _pipeline_or_exit(settings: Settings, pipeline: str) -> Any:
    from streams.errors import TaskError
    from streams.pipelines.registry import PipelineRegistry

    try:
        return PipelineRegistry.load(settings.pipelines_dir, settings.schemas_dir).get(pipeline)
    except (ConfigError, TaskError) as exc:
        click.echo(f"ab: {exc}", err=True)
        sys.exit(2)


@ab.command("report")
@click.option("--pipeline", required=True, help="Pipeline whose versions to compare.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def ab_report(pipeline: str, as_json: bool) -> None:
    """Per version: content pass rate, repairs, cost per answered task (95% intervals),
    and label agreement between versions on the tasks both answered."""
    import orjson
    from rich.console import Console
    from rich.table import Table

    from streams.ops.ab import gather, report

    settings = settings_or_exit()
    found = _pipeline_or_exit(settings, pipeline)
    evidence = on_kafka(settings, gather(settings, pipeline))
    data = report(evidence, found.output_schema)
    if as_json:
        click.echo(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode())
        return
    console = Console(soft_wrap=True)
    if not data["versions"]:
        console.print(f"{pipeline}: no results or dead letters yet", highlight=False)
        return

    def pct(x: float | None) -> str:
        return "–" if x is None else f"{x:.1%}"

    columns = ("version", "tasks", "pass rate (95% CI)", "repaired", "dead letters",
               "cost / answered task (95% CI)")  # fmt: skip
    table = Table(*columns, title=f"{pipeline}: prompt versions")
    for v in data["versions"]:
        lo, hi = v["pass_rate_ci"]
        cost, ci = v["cost_per_accepted_usd"], v["cost_per_accepted_ci"]
        table.add_row(
            v["version"], str(v["tasks"]), f"{pct(v['pass_rate'])} ({pct(lo)} – {pct(hi)})",
            pct(v["repair_rate"]), pct(v["dead_letter_rate"]),
            "–" if cost is None else f"${cost:.6f} (${ci[0]:.6f} – ${ci[1]:.6f})",
        )  # fmt: skip
    console.print(table)
    for pair in data["pairs"]:
        a, b = pair["versions"]
        diff = pair["pass_rate_difference"]
        if diff is not None:
            lo, hi = diff["ci"]
            verdict = ("no significant difference" if lo <= 0 <= hi
                       else f"{a} {'better' if lo > 0 else 'worse'}")  # fmt: skip
            console.print(f"pass rate {a} − {b}: {diff['value']:+.1%} (95% CI {lo:+.1%} to "
                          f"{hi:+.1%}): {verdict}", highlight=False)  # fmt: skip
        for g in pair["agreement"]:
            lo, hi = g["ci"]
            console.print(f"  {g['label']}: {a} and {b} agree on {g['rate']:.1%} of the "
                          f"{g['compared']} task(s) both answered (95% CI {lo:.1%} – {hi:.1%})",
                          highlight=False)  # fmt: skip


@ab.command("promote")
@click.option("--pipeline", required=True)
@click.option("--version", "version", required=True, help="The version to promote.")
@click.option(
    "--share",
    type=click.FloatRange(0.0, 1.0, min_open=True),
    default=1.0,
    show_default=True,
    help="Its share of the traffic (1: all, and the default).",
)
@click.option("--reason", required=True, help="Why: recorded with the decision.")
@click.option("--by", default=None, help="Who decides (default: the user running this).")
@click.option(
    "--min-judged",
    type=click.IntRange(1),
    default=PromotionGuard.min_judged,
    show_default=True,
    help="Judged tasks the version needs before it can be promoted.",
)
@click.option(
    "--max-cost-increase",
    type=click.FloatRange(0.0),
    default=PromotionGuard.max_cost_increase,
    show_default=True,
    help="Refused when its cost per answered task is significantly more than (1 + this) "
    "times a rival's (inf: cost not checked).",
)
@click.option("--force", is_flag=True, help="Promote even if the guard refuses (recorded).")
def ab_promote(pipeline: str, version: str, share: float, reason: str, by: str | None,
               min_judged: int, max_cost_increase: float, force: bool) -> None:  # fmt: skip
    """Give a version (all or a share of) the traffic in the pipeline file, after a guard:
    refused when it has too few judged tasks, or when its pass rate is significantly
    worse, or its cost per answered task significantly higher (see --max-cost-increase),
    than a version it takes traffic from. The decision is recorded on the decisions
    topic first, with the guard's limits."""
    from streams.ops.ab import (
        PromotionRefused,
        decision,
        gather,
        guard,
        pipeline_file,
        record_decision,
        rewrite,
        rivals_of,
    )

    settings = settings_or_exit()
    found = _pipeline_or_exit(settings, pipeline)
    if version not in found.versions:
        click.echo(f"ab promote: {pipeline} has no version {version!r} "
                   f"(known: {', '.join(sorted(found.versions))})", err=True)  # fmt: skip
        sys.exit(2)
    evidence = on_kafka(settings, gather(settings, pipeline))
    rules = PromotionGuard(min_judged=min_judged, max_cost_increase=max_cost_increase)
    try:
        guard(evidence, version, rivals_of(found.spec, version), rules)
    except PromotionRefused as exc:
        if not force:
            click.echo(f"ab promote: refused: {exc}", err=True)
            sys.exit(1)
        click.echo(f"ab promote: the guard refused ({exc}); promoting anyway (--force)")
    path = pipeline_file(settings.pipelines_dir, pipeline)
    before, after = rewrite(path, version, share, write=False)  # checked, not yet written
    record = decision(pipeline, version, share, reason, evidence, by=by, forced=force,
                      before=before, after=after, rules=rules)  # fmt: skip
    on_kafka(settings, record_decision(settings, record))
    rewrite(path, version, share)
    split = " / ".join(f"{v} {w:g}" for v, w in after["traffic"].items())
    click.echo(f"{pipeline}: traffic {split}, default {after['default_version']} "
               f"(written to {path}; workers take it when they start)")  # fmt: skip


@ab.command("log")
@click.option("--pipeline", default=None, help="Only this pipeline's decisions.")
def ab_log(pipeline: str | None) -> None:
    """The decisions recorded so far, oldest first."""
    from streams.ops.ab import decisions

    settings = settings_or_exit()
    for d in on_kafka(settings, decisions(settings, pipeline)):
        split = " / ".join(
            f"{v} {w:g}" for v, w in (d.get("after") or {}).get("traffic", {}).items()
        )
        forced = " (forced)" if d.get("forced") else ""
        click.echo(f"{d.get('at')} {d.get('pipeline')}: {d.get('version')} -> {split} by "
                   f"{d.get('by')}{forced}: {d.get('reason')}")  # fmt: skip


@cli.command("drift")
@click.option("--pipeline", required=True)
@click.option("--version", "version", default=None, help="Only this version (default: each).")
@click.option(
    "--baseline",
    default="stored",
    show_default=True,
    help="stored | version:V (its latest answers) | window:FROM..TO (ISO times).",
)
@click.option(
    "--window",
    type=click.IntRange(min=1),
    default=1000,
    show_default=True,
    help="The latest answers per version compared.",
)
@click.option("--save-baseline", is_flag=True,
              help="Store the baseline chosen (with `stored`: the current window) for the "
              "workers.")  # fmt: skip
def drift_command(pipeline: str, version: str | None, baseline: str, window: int,
                  save_baseline: bool) -> None:  # fmt: skip
    """Output drift per prompt version: label shares (PSI), numbers and length (KS), the
    share of optional fields left null or at their default, against a baseline."""
    from rich.console import Console
    from rich.table import Table

    from streams.ops.drift import Baseline, drift

    settings = settings_or_exit()
    found = _pipeline_or_exit(settings, pipeline)
    try:
        chosen = Baseline.parse(baseline)
    except ValueError as exc:
        click.echo(f"drift: --baseline {exc}", err=True)
        sys.exit(2)
    rows, saved = on_kafka(settings, drift(settings, pipeline, found.output_schema,
                                           version=version, baseline=chosen, window=window,
                                           save=save_baseline))  # fmt: skip
    console = Console(soft_wrap=True)
    if not rows:
        console.print(f"{pipeline}: no answers yet", highlight=False)
    for v in rows:
        table = Table("field", "divergence", "null / default", "shares now (baseline)",
                      title=f"{pipeline} {v.version}: {v.answers} answer(s) against "
                      f"{chosen.describe()} ({v.baseline_answers})")  # fmt: skip
        for f in v.fields:
            div = "–" if f.divergence is None else f"{f.measure} {f.divergence:.3f}"
            if f.divergence is not None and f.divergence > DRIFT_THRESHOLD:
                div += "  DRIFT"
            null = "–"
            if f.empty_ratio is not None:
                base = f.baseline_empty_ratio
                null = f"{f.empty_ratio:.1%}" + ("" if base is None else f" ({base:.1%})")
            top = sorted(f.shares.items(), key=lambda kv: -kv[1])[:4]
            shares = ", ".join(
                f"{k} {x:.0%}" + (f" ({f.baseline_shares[k]:.0%})" if k in f.baseline_shares
                                   else "")
                for k, x in top if x > 0
            )  # fmt: skip
            table.add_row(f.field, div, null, shares or "–")
        console.print(table)
    for name in saved:
        console.print(f"saved as {pipeline} {name}'s baseline (workers read it within "
                      f"{settings.drift.refresh_s:g} s)", highlight=False)  # fmt: skip


@cli.group()
def pipelines() -> None:
    """Pipeline files."""


@pipelines.command("validate")
@click.option("--dir", "directory", type=click.Path(path_type=Path), default=None)
@click.option("--endpoint", is_flag=True,
              help="Also ask the configured LLM endpoint what it is (window, slots) and which "
              "structured-output modes it honours, for each version's model.")  # fmt: skip
def pipelines_validate(directory: Path | None, endpoint: bool) -> None:
    """Load every pipeline file, check slots, templates and output schemas."""
    from streams.pipelines.registry import PipelineRegistry
    from streams.pipelines.structured import strict_dropped, strict_subset_issues

    settings = settings_or_exit()
    try:
        registry = PipelineRegistry.load(directory or settings.pipelines_dir, settings.schemas_dir)
    except ConfigError as exc:
        click.echo(f"invalid: {exc}", err=True)
        sys.exit(1)
    for name, p in sorted(registry.pipelines.items()):
        versions = ", ".join(sorted(p.versions))
        split = (
            ", traffic " + " / ".join(f"{v} {w:g}" for v, w in sorted(p.spec.traffic.items()))
            if p.spec.traffic
            else ""
        )
        click.echo(f"ok  {name}: versions {versions} (default {p.spec.default_version}{split})")
        for v, spec in sorted(p.spec.versions.items()):
            for warning in spec.warnings():
                click.echo(f"warn {name} {v}: {warning}")
        strict = sorted(v for v, spec in p.spec.versions.items()
                        if spec.response_format in ("json_schema", "tool_call"))  # fmt: skip
        for issue in strict_subset_issues(p.output_schema) if strict else []:
            note = "OpenAI refuses it in strict mode"
            click.echo(f"warn {name} {', '.join(strict)}: output schema {issue} ({note})")
        dropped = strict_dropped(p.output_schema) if strict else []
        if dropped:
            click.echo(f"note {name}: {len(dropped)} keyword(s) outside OpenAI's strict subset "
                       "are checked here and left out of the request: "
                       + ", ".join(dropped))  # fmt: skip
    if endpoint:
        from streams.ops.endpoint import endpoint_report

        for line in asyncio.run(endpoint_report(settings, registry)):
            click.echo(line)


@cli.command()
def acls() -> None:
    """The least Kafka ACLs the worker and each command need, for these settings."""
    from streams.kafka.acls import markdown
    from streams.pipelines.registry import PipelineRegistry

    settings = settings_or_exit()
    try:
        registry = PipelineRegistry.load(settings.pipelines_dir, settings.schemas_dir)
    except ConfigError as exc:
        click.echo(f"invalid: {exc}", err=True)
        sys.exit(1)
    click.echo(markdown(settings, sorted(registry.sources())))


def main() -> None:
    cli()
