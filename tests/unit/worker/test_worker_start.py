"""What the worker refuses before it starts, and what it waits for."""

from __future__ import annotations

import pytest

from streams.errors import ConfigError


def test_what_waiting_may_mend_is_told_apart_from_what_it_cannot() -> None:
    import socket
    import ssl

    from aiokafka.errors import (
        KafkaConnectionError,
        KafkaTimeoutError,
        SaslAuthenticationFailed,
        TopicAuthorizationFailedError,
    )

    from streams.errors import ConfigError
    from streams.kafka.security import BrokerAway, broker_away

    away = [ConnectionRefusedError(111, "refused"), ConnectionResetError(), TimeoutError(),
            KafkaConnectionError("closed"), KafkaTimeoutError(), BrokerAway("all refused"),
            socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")]  # fmt: skip
    not_away = [socket.gaierror(socket.EAI_NONAME, "Name or service not known"),
                SaslAuthenticationFailed("bad password"), ssl.SSLCertVerificationError(),
                TopicAuthorizationFailedError(), ConfigError("source topics do not exist"),
                ValueError("a bug")]  # fmt: skip
    assert [broker_away(e) for e in away] == [True] * len(away)
    assert [broker_away(e) for e in not_away] == [False] * len(not_away)


async def test_a_worker_starting_while_kafka_is_away_waits_for_it_then_gives_up() -> None:
    from streams.kafka.security import BrokerAway
    from streams.worker.run import while_kafka_away

    tries: list[int] = []

    async def start() -> str:
        tries.append(1)
        if len(tries) < 3:
            raise BrokerAway("cannot reach Kafka: 127.0.0.1:9092: [Errno 111] refused")
        return "started"

    assert await while_kafka_away(start, wait_s=30) == "started"  # back after two tries
    assert len(tries) == 3

    async def never() -> str:
        raise BrokerAway("cannot reach Kafka")

    import time

    began = time.monotonic()
    with pytest.raises(BrokerAway):
        await while_kafka_away(never, wait_s=1.5)
    assert time.monotonic() - began < 10  # the bound, plus one wait at most

    async def wrong_host() -> str:
        raise ConfigError("cannot reach Kafka: no-such-host:9092: Name or service not known")

    with pytest.raises(ConfigError):
        await while_kafka_away(wrong_host, wait_s=300)  # at once: waiting cannot mend it


def test_a_started_worker_sets_its_heap_aside_from_full_collections() -> None:
    """What the worker holds once started is frozen (the collector's full passes over it
    paused the loop 30-180 ms); what is garbage then is collected first, not frozen."""
    import gc
    import weakref

    from streams.worker.run import freeze_started_heap

    class Node:
        def __init__(self) -> None:
            self.me = self  # a cycle: only the collector frees it

    held, dropped = Node(), Node()
    gone = weakref.ref(dropped)
    del dropped
    try:
        frozen = freeze_started_heap()
        assert frozen == gc.get_freeze_count() > 0
        assert gone() is None  # collected before the freeze, not kept for ever
        # Out of the oldest generation, which each full pass walks.
        assert all(o is not held for o in gc.get_objects(generation=2))
    finally:
        gc.unfreeze()
