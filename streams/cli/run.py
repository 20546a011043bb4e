"""Commands that run something: the worker, the LLM simulator, the demo."""

from __future__ import annotations

import sys
from typing import Any

import click

# Above this divergence (PSI or KS) a field is said to drift: the alert rule's threshold
from streams.cli.base import cli, settings_or_exit
from streams.errors import ConfigError


@cli.command()
@click.option(
    "-l",
    "--loglevel",
    "log_level",
    default=None,
    type=click.Choice(["debug", "info", "warning", "error", "critical"], case_sensitive=False),
    help="Log level (else LLM_STREAMS_LOG_LEVEL).",
)
@click.option(
    "--web-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Status and metrics port (else LLM_STREAMS_WEB_PORT).",
)
@click.option(
    "--web-bind",
    default=None,
    help="Address of the web port, 0.0.0.0 in a container (else LLM_STREAMS_WEB_BIND).",
)
@click.option(
    "--json-logs",
    is_flag=True,
    default=False,
    help="Log lines as JSON objects (else LLM_STREAMS_LOG_FORMAT).",
)
def worker(log_level: str | None, web_port: int | None, web_bind: str | None,
           json_logs: bool) -> None:  # fmt: skip
    """Run a worker (Faust) with the settings from the environment; the options, in
    Faust's style, win over their variables."""
    from streams.worker.run import run_worker

    given = {"log_level": log_level, "web_port": web_port, "web_bind": web_bind,
             "log_format": "json" if json_logs else None}  # fmt: skip
    try:
        run_worker(settings_or_exit(**{k: v for k, v in given.items() if v is not None}))
    except ConfigError as exc:  # the broker's topics or features do not fit the settings
        click.echo(f"llm-streams: {exc}", err=True)
        sys.exit(2)


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
@click.option("--prompt-cache-min-tokens", type=int, default=None,
              help="Say a repeated first message of at least this many tokens was read from "
              "a prompt cache (OpenAI: 1024); unset: no cache.")  # fmt: skip
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
@click.option(
    "--keep",
    is_flag=True,
    help="Keep broker, LLM and worker up after the summary, until Ctrl-C: for the "
    "dashboard, `status`, `tail` and `publish` from another shell.",
)
def demo(count: int, timeout: float, quiet: bool, external: bool, keep: bool) -> None:
    """Embedded broker + simulator (or your endpoint) + worker + sample comments, live."""
    from streams.dev.demo import run_demo

    try:
        sys.exit(run_demo(count=count, timeout_s=timeout, quiet=quiet, external=external,
                          keep=keep))  # fmt: skip
    except ConfigError as exc:
        click.echo(f"llm-streams: {exc}", err=True)
        sys.exit(2)
