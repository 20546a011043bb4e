"""Commands about pipelines: validate (and the endpoint they run on), drift, spend caps,
the ACLs."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import click

from streams.cli.base import cli, on_kafka, pipeline_or_exit, registry_or_exit, settings_or_exit

# Above this divergence (PSI or KS) a field is said to drift: the alert rule's threshold
# (deploy/prometheus/rules.yml, LLMStreamsOutputDrift).
DRIFT_THRESHOLD = 0.15


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
    from rich.text import Text

    from streams.ops.drift import Baseline, drift

    settings = settings_or_exit()
    found = pipeline_or_exit(settings, pipeline, "drift")
    try:
        chosen = Baseline.parse(baseline)
    except ValueError as exc:
        click.echo(f"drift: --baseline {exc}", err=True)
        sys.exit(2)
    rows, saved = on_kafka(settings, drift(settings, pipeline, found.output_schema,
                                           version=version, baseline=chosen, window=window,
                                           save=save_baseline))  # fmt: skip
    console = Console(soft_wrap=True, markup=False)  # names and labels are text, not markup
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
            # As text: a list field's values are what the model wrote ("[/b]" is no markup).
            table.add_row(Text(f.field), div, null, Text(shares or "–"))
        console.print(table)
    for name in saved:
        console.print(f"saved as {pipeline} {name}'s baseline (workers read it within "
                      f"{settings.drift.refresh_s:g} s)", highlight=False)  # fmt: skip


CAPS = {  # option -> (scope, field): scope None is the pipeline's caps over every lane
    "usd_per_hour": (None, "usd_per_hour"), "usd_per_day": (None, "usd_per_day"),
    "live_usd_per_hour": ("live", "usd_per_hour"), "live_usd_per_day": ("live", "usd_per_day"),
    "replay_usd_per_hour": ("replay", "usd_per_hour"),
    "replay_usd_per_day": ("replay", "usd_per_day"),
}  # fmt: skip


def _usd(value: str | None) -> float | str | None:
    """A cap option's value: USD > 0, or `none` (no such cap); unset: None."""
    if value is None or value.lower() == "none":
        return "none" if value is not None else None
    try:
        usd = float(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a number of USD (or `none`)") from None
    if not usd > 0:
        raise click.BadParameter("a cap is more than 0 USD (`none`: no such cap)")
    return usd


def _cap_option(name: str) -> Any:
    flag = "--" + name.replace("_", "-")
    return click.option(flag, name, default=None, metavar="USD|none",
                        callback=lambda _ctx, _param, value: _usd(value))  # fmt: skip


def _budget_options(command: Any) -> Any:
    for name in reversed(CAPS):
        command = _cap_option(name)(command)
    return command


@cli.command("budget")
@click.argument("pipeline")
@_budget_options
@click.option("--reset", is_flag=True, help="Back to the caps of the pipeline's file.")
def budget_command(pipeline: str, reset: bool, **caps: float | str | None) -> None:
    """A pipeline's spend caps (or a deployment's: `deployment:NAME`): shown, or changed
    while the workers run (they take them within LLM_STREAMS_BUDGET__REFRESH_S; tasks
    waiting at a cap raised go on at once). Each option changes one cap, the others
    stay; `none` removes one."""
    from streams.pipelines.specs import BudgetSpec
    from streams.store.budgets import load_budgets, save_budget

    settings = settings_or_exit()
    given = {k: v for k, v in caps.items() if v is not None}
    if reset and given:
        click.echo("budget: --reset sets the file's caps back; give no cap with it", err=True)
        sys.exit(2)
    filed = _filed_caps(settings, pipeline, given)
    stored = on_kafka(settings, load_budgets(settings)).get(pipeline)
    now: BudgetSpec | None = stored[0] if stored is not None else filed
    if reset or given:
        new = None if reset else _changed(now or BudgetSpec(), given)
        on_kafka(settings, save_budget(settings, pipeline, new))
        now = filed if reset else new
        whose = "the file's" if reset else "set"
        click.echo(f"{pipeline}: spend caps now {_shown(now)} ({whose}; the workers take them "
                   f"within {settings.budget.refresh_s:g} s)")  # fmt: skip
        return
    whose = f"set {stored[1].get('at', '')}".strip() if stored is not None else "its file's"
    click.echo(f"{pipeline}: spend caps {_shown(now)} ({whose})")
    if stored is not None:
        click.echo(f"  its file says: {_shown(filed)} (`--reset` to go back)")


def _filed_caps(settings: Any, name: str, given: dict[str, float | str]) -> Any:
    """The caps its file gives a pipeline, or a deployment (`deployment:NAME`, from the
    deployments file: caps over every lane only); a name neither file knows: exit."""
    from streams.errors import ConfigError
    from streams.ops.caps import deployment_caps, is_deployment

    if not is_deployment(name):
        return pipeline_or_exit(settings, name, "budget").spec.budget
    lanes = sorted(k for k in given if CAPS[k][0] is not None)
    if lanes:
        flag = "--" + lanes[0].replace("_", "-")
        click.echo(f"budget: a deployment's caps are over every lane: no {flag}", err=True)
        sys.exit(2)
    try:
        return deployment_caps(settings, name)
    except ConfigError as exc:
        click.echo(f"budget: {exc}", err=True)
        sys.exit(2)


def _changed(spec: Any, given: dict[str, float | str]) -> Any:
    from streams.pipelines.specs import BudgetSpec, Caps

    fields = spec.model_dump()
    for option, value in given.items():
        scope, name = CAPS[option]
        usd = None if value == "none" else value
        if scope is None:
            fields[name] = usd
        else:
            fields[scope] = {**(fields.get(scope) or {}), name: usd}
    for scope in ("live", "replay"):
        if fields.get(scope) is not None and not any(Caps(**fields[scope]).model_dump().values()):
            fields[scope] = None
    return BudgetSpec(**fields)


def _shown(spec: Any) -> str:
    return "none" if spec is None else str(spec.describe())


@cli.group()
def pipelines() -> None:
    """Pipeline files."""


def _reported(name: str, p: Any) -> bool:
    """A pipeline's lines of `pipelines validate`; False when it cannot run as it says."""
    from streams.pipelines.structured import strict_dropped, strict_subset_issues
    from streams.worker.sinks import sink_problem

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
    sink = p.spec.sink
    if sink is None:
        return True
    click.echo(f"sink {name}: {sink.topic} ({sink.shape}, key {sink.key}, {sink.format})")
    problem = sink_problem(sink, p.output_schema)
    if problem is not None:
        click.echo(f"invalid {name}: sink: {problem}")
    return problem is None


@pipelines.command("validate")
@click.option("--dir", "directory", type=click.Path(path_type=Path), default=None)
@click.option("--endpoint", is_flag=True,
              help="Also ask the configured LLM endpoint what it is (window, slots) and which "
              "structured-output modes it honours, for each version's model.")  # fmt: skip
def pipelines_validate(directory: Path | None, endpoint: bool) -> None:
    """Load every pipeline file, check slots, templates, output schemas and sinks."""
    settings = settings_or_exit()
    registry = registry_or_exit(settings, directory=directory)
    broken = sum(not _reported(name, p) for name, p in sorted(registry.pipelines.items()))
    if broken:
        sys.exit(1)
    if endpoint:
        from streams.ops.endpoint import endpoint_report

        for line in asyncio.run(endpoint_report(settings, registry)):
            click.echo(line)


@cli.command()
def acls() -> None:
    """The least Kafka ACLs the worker and each command need, for these settings."""
    from streams.kafka.acls import markdown

    settings = settings_or_exit()
    registry = registry_or_exit(settings)
    click.echo(markdown(settings, sorted(registry.sources()), sorted(registry.sinks())))
