"""The worker's reader of its small compacted topics (`kafka.scan.Follower`: the spend caps,
the spend under them, the drift baselines) on a real broker: each read answers what the
topic holds now — updates, tombstones, a topic made after the first read, a topic made
again — and a stopped follower reads no more and holds no client."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from aiokafka.admin import AIOKafkaAdminClient

from streams.kafka import clients
from streams.kafka.scan import Follower, latest_of
from streams.kafka.topics import budget_spend_topic, budgets_topic, ensure_topics
from streams.settings import Settings

pytestmark = pytest.mark.integration


async def _write(settings: Settings, topic: str, records: list[tuple[bytes, Any]]) -> None:
    producer = clients.producer(settings, acks="all")
    await producer.start()
    try:
        for key, value in records:
            raw = orjson.dumps(value) if value is not None else None
            await producer.send_and_wait(topic, raw, key=key)
    finally:
        await producer.stop()


async def _delete(settings: Settings, topic: str) -> None:
    admin: AIOKafkaAdminClient = clients.admin(settings)
    await admin.start()
    try:
        await admin.delete_topics([topic])
    finally:
        await admin.close()


async def test_each_read_answers_what_the_topics_hold_now(make_settings: Any) -> None:
    settings = make_settings()
    caps, spend = budgets_topic(settings), budget_spend_topic(settings)
    await ensure_topics(settings, [caps])  # the spend topic is made later
    follower = Follower(settings, [caps, spend])
    try:
        assert await follower.latest_each(caps, spend) == {caps: {}, spend: {}}  # one read
        await _write(settings, caps, [(b"p1", {"usd_per_hour": 1}), (b"p2", {"usd_per_hour": 2})])
        assert await follower.latest(caps) == {b"p1": {"usd_per_hour": 1},
                                               b"p2": {"usd_per_hour": 2}}  # fmt: skip
        # An update, a tombstone and a value that is no JSON object, since the last read.
        await _write(settings, caps, [(b"p1", {"usd_per_hour": 5}), (b"p2", None),
                                      (b"p3", [1, 2])])  # fmt: skip
        assert await follower.latest(caps) == {b"p1": {"usd_per_hour": 5}}
        # A topic made after the first read is found at the next.
        await ensure_topics(settings, [spend])
        await _write(settings, spend, [(b"0/h", {"usd": 0.5})])
        assert await follower.latest(spend) == {b"0/h": {"usd": 0.5}}
        assert await follower.latest(caps) == await latest_of(settings, caps)  # a whole read
    finally:
        await follower.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        await follower.latest(caps)


async def test_after_a_failed_read_the_topic_is_read_afresh(make_settings: Any) -> None:
    """A read that fails closes the clients and forgets what was read: a topic deleted and
    made again (its reader then fails with stale metadata) is read from its beginning."""
    settings = make_settings()
    caps = budgets_topic(settings)
    await ensure_topics(settings, [caps])
    await _write(settings, caps, [(f"p{i}".encode(), {"usd_per_hour": i}) for i in range(6)])
    follower = Follower(settings, [caps])
    try:
        assert len(await follower.latest(caps)) == 6
        await _delete(settings, caps)
        await follower.close()  # what a read that fails does (a topic made again: StaleMetadata)
        await ensure_topics(settings, [caps])
        await _write(settings, caps, [(b"q", {"usd_per_hour": 9})])
        assert await follower.latest(caps) == {b"q": {"usd_per_hour": 9}}  # nothing of before
    finally:
        await follower.stop()
