"""A real Kafka broker for the integration tests.

Order of preference: `KAFKA_BOOTSTRAP_SERVERS` (an external broker), the official
`apache/kafka` image through testcontainers when a Docker engine answers
(streams.dev.brokers.docker), else Apache Kafka 4.x in KRaft mode from Maven Central jars
on the local Java 17 (streams.dev.brokers.apache).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from streams.dev.brokers.apache import ApacheKafka
from streams.dev.brokers.docker import official_kafka
from streams.dev.registry import SchemaRegistry
from streams.settings import Settings, load_settings

pytestmark = pytest.mark.integration


def _docker_answers() -> bool:
    if not os.environ.get("DOCKER_HOST") and not os.path.exists("/var/run/docker.sock"):
        return False
    try:
        import docker

        client = docker.from_env(timeout=2)
    except Exception:
        return False
    try:
        return bool(client.ping())
    except Exception:
        return False
    finally:
        client.close()


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    external = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if external:
        yield external
        return
    if os.environ.get("LLM_STREAMS_TEST_DOCKER", "1") != "0" and _docker_answers():
        with official_kafka() as bootstrap:
            yield bootstrap
        return
    broker = ApacheKafka().start()
    try:
        yield broker.bootstrap
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def schema_registry() -> Iterator[str]:
    """A real schema registry (Confluent's REST API; streams.dev.registry): its URL."""
    with SchemaRegistry() as registry:
        yield registry.url


@pytest.fixture
def make_settings(
    kafka_bootstrap: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., Settings]:
    """Settings with unique topics, app id and data dir for this test."""
    for var in list(os.environ):
        if var.startswith("LLM_STREAMS_") or var in ("OPENAI_API_KEY", "OPENAI_BASE_URL"):
            monkeypatch.delenv(var, raising=False)

    def make(**overrides: Any) -> Settings:
        suffix = uuid.uuid4().hex[:8]
        base: dict[str, Any] = {
            "app_id": f"test-{suffix}",
            "kafka": {"broker_url": f"kafka://{kafka_bootstrap}", "partitions": 4,
                      "session_timeout_s": 10, "commit_interval_s": 0.2},
            "topics": {name: f"{name}-{suffix}" for name in
                       ("tasks", "replay", "results", "dead_letters", "review")},
            "data_dir": tmp_path / f"worker-{suffix}",
        }  # fmt: skip
        for key, value in overrides.items():
            if isinstance(value, dict) and isinstance(base.get(key), dict):
                base[key] = {**base[key], **value}
            else:
                base[key] = value
        return load_settings(**base)

    return make
