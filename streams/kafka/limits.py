"""How large a record each topic takes, and which write errors no retry can mend.

The producer refuses a record over its `max_request_size` before sending it
(aiokafka's MessageSizeTooLargeError), the broker one over the topic's
`max.message.bytes` (default ~1 MiB) — whatever the input topic allowed the
record that caused it. The worker reads the limit of every topic it writes at
start, so the core can make each record fit before it is written: a dead letter
keeps a head of a large payload, a result too large becomes a dead letter, a
task state drops what can be asked again. A refusal that still comes back
(the topic's limit lowered since, a missing ACL) is told apart from a broker
that is merely away: only the latter is worth retrying.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    CorruptRecordException,
    InvalidTopicError,
    KafkaConnectionError,
    KafkaError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
    TopicAuthorizationFailedError,
    TransactionalIdAuthorizationFailed,
)

from streams.contract.records import ValueLimits
from streams.kafka.clients import admin
from streams.settings import Settings

log = logging.getLogger(__name__)

# Kafka's default message.max.bytes: what a topic takes when nobody set it.
KAFKA_DEFAULT_MAX_MESSAGE_BYTES = 1_048_588
# Key (task ids of up to 512 characters), headers (trace context, routing) and the
# record batch's own overhead, kept out of what a value may take.
RESERVE_BYTES = 4096
_INVALID_RECORD = 87  # INVALID_RECORD: the broker's validation refused the record


@dataclass(frozen=True)
class WriteLimits:
    """The producer's request limit and each written topic's `max.message.bytes`."""

    producer_bytes: int = 1_048_576
    topic_bytes: Mapping[str, int] = field(default_factory=dict)
    # Partitions of the written topics that are not co-partitioned with the tasks (the
    # pipelines' sinks): their records are spread by key over them.
    partitions: Mapping[str, int] = field(default_factory=dict)
    # How a sink topic's values go on the wire when its format is the schema registry's
    # (`format: json_schema | avro`): the JSON value in, the framed record value out.
    framing: Mapping[str, Callable[[bytes], bytes]] = field(default_factory=dict)

    def max_record(self, topic: str) -> int:
        topic_limit = self.topic_bytes.get(topic, KAFKA_DEFAULT_MAX_MESSAGE_BYTES)
        return min(self.producer_bytes, topic_limit)

    def value_bytes(self, topic: str) -> int:
        """Bytes a value written to `topic` may take."""
        return max(1024, self.max_record(topic) - RESERVE_BYTES)

    def value_limits(self, settings: Settings) -> ValueLimits:
        """What the core needs: the bytes a result and a dead letter may take."""
        return ValueLimits(
            result=min(
                self.value_bytes(settings.topics.results), self.value_bytes(settings.topics.review)
            ),
            dead_letter=self.value_bytes(settings.topics.dead_letters),
            others={topic: self.value_bytes(topic) for topic in self.topic_bytes},
            default=self.value_bytes(""),
        )


async def read_limits(
    settings: Settings, topics: list[str], *, timeout_s: float = 15.0
) -> WriteLimits:
    """The limits of `topics` as the broker reports them. A topic it does not describe
    keeps Kafka's default; a broker that describes no configs (the demo's Tansu closes
    the connection on DescribeConfigs) leaves every topic at Kafka's default, said once
    at info; a broker that could not be asked, with a warning."""
    try:
        async with asyncio.timeout(timeout_s):
            found = await _topic_limits(settings, topics)
    except _NotDescribed:
        log.info("the broker does not describe topic configs; assuming Kafka's default "
                 "of %d bytes per record", KAFKA_DEFAULT_MAX_MESSAGE_BYTES)  # fmt: skip
        found = {}
    except (KafkaError, OSError, TimeoutError) as exc:
        log.warning("the broker did not say what its topics take (%r); assuming Kafka's "
                    "default of %d bytes", exc, KAFKA_DEFAULT_MAX_MESSAGE_BYTES)  # fmt: skip
        found = {}
    limits = WriteLimits(settings.kafka.max_request_bytes, found)
    log.info("largest record per topic: %s",
             {t: limits.max_record(t) for t in topics})  # fmt: skip
    return limits


class _NotDescribed(Exception):
    """The broker, reached, dropped the connection on DescribeConfigs: it does not serve it."""


async def _topic_limits(settings: Settings, topics: list[str]) -> dict[str, int]:
    client = admin(settings)
    await client.start()
    try:
        found: dict[str, int] = {}
        wanted = [ConfigResource(ConfigResourceType.TOPIC, name, {"max.message.bytes": None})
                  for name in topics]  # fmt: skip
        try:
            responses = await client.describe_configs(wanted)
        except KafkaConnectionError as exc:
            raise _NotDescribed from exc
        for response in responses:
            for error_code, _msg, _type, name, entries in response.resources:
                if error_code != 0:
                    continue
                for entry in entries:
                    if entry[0] == "max.message.bytes" and entry[1] is not None:
                        found[name] = int(entry[1])
        return found
    finally:
        await client.close()


class Unencodable(KafkaError):  # type: ignore[misc]  # aiokafka is untyped here
    """A record its topic's registered schema cannot hold (a sink's framing refused it):
    no retry mends it."""


def refused_for_good(exc: BaseException) -> str | None:
    """The code of a write refusal that no retry can mend (the record is too large or
    invalid, or this client may not write there), or None: worth another try."""
    if isinstance(exc, MessageSizeTooLargeError | RecordListTooLargeError | RecordTooLargeError):
        return "record_too_large"
    if isinstance(exc, CorruptRecordException | InvalidTopicError):
        return "invalid_record"
    if isinstance(exc, Unencodable):
        return "unencodable"
    if isinstance(exc, KafkaError) and getattr(exc, "errno", None) == _INVALID_RECORD:
        return "invalid_record"
    if isinstance(
        exc,
        TopicAuthorizationFailedError
        | ClusterAuthorizationFailedError
        | TransactionalIdAuthorizationFailed,
    ):
        return "not_authorized"
    return None
