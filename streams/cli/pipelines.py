"""Commands about pipelines: validate (and the endpoint they run on), drift, the ACLs."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import click

# Above this divergence (PSI or KS) a field is said to drift: the alert rule's threshold
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
    from streams.pipelines.structured import strict_dropped, strict_subset_issues

    settings = settings_or_exit()
    registry = registry_or_exit(settings, directory=directory)
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

    settings = settings_or_exit()
    registry = registry_or_exit(settings)
    click.echo(markdown(settings, sorted(registry.sources())))
