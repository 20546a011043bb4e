"""What every command shares: the group, settings or a one-line exit, times, Kafka work
after the connection check, the pipelines loaded once (or a one-line exit)."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Coroutine
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import click

from streams.errors import ConfigError
from streams.settings import Settings, load_settings

# Above this divergence (PSI or KS) a field is said to drift: the alert rule's threshold


def read_env_file(path: Path) -> None:
    """`NAME=value` lines of `path` into the environment, under what it already sets (as
    Docker Compose and most tools read `.env`); no file, nothing read."""
    if not path.is_file():
        return
    from dotenv import dotenv_values

    for name, value in dotenv_values(path).items():
        if value is not None:
            os.environ.setdefault(name, value)


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
    from streams.contract.records import stored_time

    when = stored_time(value)
    if when is None:
        click.echo(f"{option}: not an ISO time: {value!r}", err=True)
        sys.exit(2)
    return when


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


def load_pipelines(settings: Settings, directory: Path | None = None) -> Any:
    """The pipelines of `directory` (else the settings'): the one loader of every command."""
    from streams.pipelines.registry import PipelineRegistry

    return PipelineRegistry.load(directory or settings.pipelines_dir, settings.schemas_dir)


def registry_or_exit(
    settings: Settings, command: str = "invalid", status: int = 1, directory: Path | None = None
) -> Any:
    """The pipelines, or `COMMAND: why` and exit `status`."""
    try:
        return load_pipelines(settings, directory)
    except ConfigError as exc:
        click.echo(f"{command}: {exc}", err=True)
        sys.exit(status)


def pipeline_or_exit(settings: Settings, name: str, command: str, status: int = 2) -> Any:
    """One pipeline by name, or `COMMAND: why` (a file's mistake, an unknown name) and exit."""
    from streams.errors import TaskError

    registry = registry_or_exit(settings, command, status)
    try:
        return registry.get(name)
    except TaskError as exc:
        click.echo(f"{command}: {exc}", err=True)
        sys.exit(status)


@click.group()
@click.version_option(package_name="llm-streams")
def cli() -> None:
    """Run LLM work on every record of a Kafka topic.

    Settings come from the environment, and from a `.env` file in the current directory
    for what the environment does not set (docs/SETTINGS.md).
    """
    read_env_file(Path(".env"))
