"""Every topic llm-streams reads or writes, and their creation on the broker."""

from __future__ import annotations

import contextlib
import logging

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from streams.errors import ConfigError
from streams.kafka import clients
from streams.settings import Settings

log = logging.getLogger(__name__)


def state_topic(settings: Settings) -> str:
    """The task store's task-state topic (compacted, co-partitioned with the tasks)."""
    return f"{settings.app_id}-task-state-changelog"


def ledger_topic(settings: Settings) -> str:
    """The batch lane's ledger: batches sent and which requests each holds (compacted,
    co-partitioned with the tasks)."""
    return f"{settings.app_id}-batch-ledger"


def replays_topic(settings: Settings) -> str:
    """Replay checkpoints, keyed by replay id (compacted)."""
    return f"{settings.app_id}-replays"


def topic_specs(settings: Settings) -> dict[str, dict[str, str]]:
    """Topic name -> config. Results are keyed by result_key and compacted."""
    t = settings.topics
    return {
        t.tasks: {},
        t.replay: {},
        t.results: {"cleanup.policy": "compact"},
        t.dead_letters: {},
        t.review: {},
        state_topic(settings): {"cleanup.policy": "compact"},
        ledger_topic(settings): {"cleanup.policy": "compact"},
        replays_topic(settings): {"cleanup.policy": "compact"},
    }


def written_topics(settings: Settings) -> list[str]:
    """Topics the worker writes (each record it writes must fit the topic's limit)."""
    t = settings.topics
    return [t.tasks, t.replay, t.results, t.dead_letters, t.review, state_topic(settings),
            ledger_topic(settings)]  # fmt: skip


async def ensure_topics(settings: Settings, *, timeout_s: float = 30.0) -> list[str]:
    """Create missing topics with the configured partitions; return the names created."""
    admin = clients.admin(settings, request_timeout_ms=int(timeout_s * 1000))
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        wanted = [
            NewTopic(
                name=name,
                num_partitions=settings.kafka.partitions,
                replication_factor=settings.kafka.replication_factor,
                topic_configs=config,
            )
            for name, config in topic_specs(settings).items()
            if name not in existing
        ]
        created = [t.name for t in wanted]
        if wanted:
            with contextlib.suppress(TopicAlreadyExistsError):  # a concurrent worker made it
                await admin.create_topics(wanted, timeout_ms=int(timeout_s * 1000))
            log.info("created topics %s", created)
        await _check_partitions(admin, settings)
        return created
    finally:
        await admin.close()


async def _check_partitions(admin: AIOKafkaAdminClient, settings: Settings) -> None:
    """The task store is co-partitioned with the task topics: every topic it reads or
    writes needs `kafka.partitions` partitions."""
    t = settings.topics
    names = [t.tasks, t.replay, t.results, t.dead_letters, state_topic(settings),
             ledger_topic(settings)]  # fmt: skip
    found: dict[str, int] = {}
    for description in await admin.describe_topics(names):
        if description.get("error_code", 0) == 0:
            found[description["topic"]] = len(description["partitions"])
    wrong = {name: n for name, n in found.items() if n != settings.kafka.partitions}
    if wrong:
        raise ConfigError(
            f"topics {wrong} have a partition count other than "
            f"LLM_STREAMS_KAFKA__PARTITIONS={settings.kafka.partitions}; the task store "
            "needs the task, replay, results and dead-letter topics co-partitioned. "
            "Set LLM_STREAMS_KAFKA__PARTITIONS to theirs or repartition them."
        )
