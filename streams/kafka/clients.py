"""Every Kafka client the project makes is built here, from the settings.

One place decides what a producer, a consumer or an admin client is given
(bootstrap servers, security — `streams.kafka.security` —, the producer's request
size limit), so no command or worker part drifts from the others or is left on
plaintext. (The Faust app gets the same security through `faust_credentials`.)
"""

from __future__ import annotations

import uuid
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

from streams.errors import ConfigError
from streams.kafka.security import client_auth
from streams.settings import Settings


def producer(settings: Settings, **options: Any) -> AIOKafkaProducer:
    """A producer that refuses, before sending, any record over the configured
    `kafka.max_request_bytes` (what the worker's size checks assume)."""
    options.setdefault("max_request_size", settings.kafka.max_request_bytes)
    return AIOKafkaProducer(
        bootstrap_servers=settings.bootstrap_servers, **client_auth(settings), **options
    )


def consumer(settings: Settings, *topics: str, purpose: str, **options: Any) -> AIOKafkaConsumer:
    """A consumer named after what it is for (`client_id` `llm-streams-<purpose>-<random>`)."""
    options.setdefault("client_id", f"llm-streams-{purpose}-{uuid.uuid4().hex[:6]}")
    return AIOKafkaConsumer(
        *topics, bootstrap_servers=settings.bootstrap_servers, **client_auth(settings), **options
    )


def reader(settings: Settings, purpose: str, **options: Any) -> AIOKafkaConsumer:
    """A group-less consumer that reads committed records of assigned partitions."""
    options.setdefault("group_id", None)
    options.setdefault("enable_auto_commit", False)
    options.setdefault("isolation_level", "read_committed")
    # A start offset the retention already deleted begins at the first record left.
    options.setdefault("auto_offset_reset", "earliest")
    # A fetch at the end of a partition answers after this wait: keep scans short.
    options.setdefault("fetch_max_wait_ms", 100)
    return consumer(settings, purpose=purpose, **options)


def admin(settings: Settings, **options: Any) -> AIOKafkaAdminClient:
    return AIOKafkaAdminClient(
        bootstrap_servers=settings.bootstrap_servers, **client_auth(settings), **options
    )


TOPIC_AUTHORIZATION_FAILED = 29


async def partitions_of(
    settings: Settings, topic: str, client: AIOKafkaAdminClient | None = None
) -> list[int]:
    """The topic's partitions (none when it does not exist); a topic this principal may
    not describe is said so (a ConfigError naming it), not taken for an empty one.
    `client`: a started admin client to ask (else one made for the question)."""
    if client is None:
        own = admin(settings)
        await own.start()
        try:
            return await partitions_of(settings, topic, own)
        finally:
            await own.close()
    for description in await client.describe_topics([topic]):
        code = description.get("error_code", 0)
        if code == TOPIC_AUTHORIZATION_FAILED:
            raise ConfigError(
                f"not authorized to DESCRIBE topic {topic!r}: grant the ACLs "
                "`llm-streams acls` lists for this command"
            )
        if code == 0 and description["topic"] == topic:
            return sorted(p["partition"] for p in description["partitions"])
    return []
