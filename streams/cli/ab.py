"""`llm-streams ab`: compare a pipeline's versions, promote one behind its guard, the log."""

from __future__ import annotations

import sys

import click

# Above this divergence (PSI or KS) a field is said to drift: the alert rule's threshold
from streams.cli.base import cli, on_kafka, pipeline_or_exit, settings_or_exit
from streams.contract.evaluation import PromotionGuard


@cli.group()
def ab() -> None:
    """A/B decisions on prompt versions: compare them, promote one."""


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
    found = pipeline_or_exit(settings, pipeline, "ab")
    evidence = on_kafka(settings, gather(settings, pipeline, found.output_schema))
    data = report(evidence, found.versions)
    if as_json:
        click.echo(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode())
        return
    console = Console(soft_wrap=True, markup=False)  # names and labels are text, not markup
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
    for v in data["versions"]:
        if v["results_made_otherwise"]:
            console.print(f"{v['version']}: {v['results_made_otherwise']} of its results were "
                          "made under an earlier definition (edited in place since): its "
                          "figures mix them; `replay --force` answers them again",
                          highlight=False)  # fmt: skip
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
    than a version it takes traffic from; or when some of its results were made under
    another definition than the file's now (edited in place). The decision is recorded on
    the decisions topic first, with the guard's limits."""
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
    found = pipeline_or_exit(settings, pipeline, "ab")
    if version not in found.versions:
        click.echo(f"ab promote: {pipeline} has no version {version!r} "
                   f"(known: {', '.join(sorted(found.versions))})", err=True)  # fmt: skip
        sys.exit(2)
    evidence = on_kafka(settings, gather(settings, pipeline, found.output_schema))
    rules = PromotionGuard(min_judged=min_judged, max_cost_increase=max_cost_increase)
    try:
        guard(evidence, version, rivals_of(found.spec, version), rules, found.versions[version])
    except PromotionRefused as exc:
        if not force:
            click.echo(f"ab promote: refused: {exc}", err=True)
            sys.exit(1)
        click.echo(f"ab promote: the guard refused ({exc}); promoting anyway (--force)")
    path = pipeline_file(settings.pipelines_dir, pipeline)
    before, after = rewrite(path, version, share, write=False)  # checked, not yet written
    record = decision(pipeline, version, share, reason, evidence, by=by, forced=force,
                      before=before, after=after, rules=rules,
                      definition=found.versions[version].digest)  # fmt: skip
    on_kafka(settings, record_decision(settings, record))
    rewrite(path, version, share)
    split = " / ".join(f"{v} {w:g}" for v, w in after["traffic"].items())
    click.echo(f"{pipeline}: traffic {split}, default {after['default_version']} "
               f"(written to {path}; workers take it when they start)")  # fmt: skip


@ab.command("log")
@click.option("--pipeline", default=None, help="Only this pipeline's decisions.")
def ab_log(pipeline: str | None) -> None:
    """The decisions recorded so far, oldest first."""
    from streams.ops.ab import decision_line, decisions

    settings = settings_or_exit()
    for d in on_kafka(settings, decisions(settings, pipeline)):
        click.echo(decision_line(d))
