"""Every topic llm-streams reads or writes, and their creation on the broker."""

from __future__ import annotations

import contextlib
import logging

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from streams.settings import Settings

log = logging.getLogger(__name__)


def topic_specs(settings: Settings) -> dict[str, dict[str, str]]:
    """Topic name -> config. Results are keyed by result_key and compacted."""
    t = settings.topics
    return {
        t.tasks: {},
        t.replay: {},
        t.results: {"cleanup.policy": "compact"},
        t.dead_letters: {},
        t.review: {},
    }


async def ensure_topics(settings: Settings, *, timeout_s: float = 30.0) -> list[str]:
    """Create missing topics with the configured partitions; return the names created."""
    admin = AIOKafkaAdminClient(
        bootstrap_servers=settings.bootstrap_servers, request_timeout_ms=int(timeout_s * 1000)
    )
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
        if not wanted:
            return []
        with contextlib.suppress(TopicAlreadyExistsError):  # a concurrent worker made it
            await admin.create_topics(wanted, timeout_ms=int(timeout_s * 1000))
        created = [t.name for t in wanted]
        log.info("created topics %s", created)
        return created
    finally:
        await admin.close()
