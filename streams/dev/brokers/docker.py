"""The official `apache/kafka` image as a plain container, for tests where Docker runs.

testcontainers' `KafkaContainer` refuses this image (it checks Confluent's version
numbers and sources Confluent's scripts; KNOWLEDGE.md), so the tests start it as a
generic container with its KRaft settings in the environment, which the image turns
into `server.properties`. The client port is bound to a fixed free host port, so the
broker can advertise the address clients reach it at.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from streams.dev.brokers.common import free_port

IMAGE = "apache/kafka:4.1.1"
STARTED = "Kafka Server started"


def kraft_env(host_port: int) -> dict[str, str]:
    """One node, broker + controller, advertising `localhost:<host_port>`."""
    return {
        "KAFKA_NODE_ID": "1",
        "KAFKA_PROCESS_ROLES": "broker,controller",
        "KAFKA_LISTENERS": "PLAINTEXT://0.0.0.0:9092,CONTROLLER://0.0.0.0:9093",
        "KAFKA_ADVERTISED_LISTENERS": f"PLAINTEXT://localhost:{host_port}",
        "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
        "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "KAFKA_CONTROLLER_QUORUM_VOTERS": "1@localhost:9093",
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": "1",
        "KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS": "0",
    }


@contextmanager
def official_kafka(image: str = IMAGE, timeout_s: float = 120) -> Iterator[str]:
    """A started container of the official image; yields its bootstrap address."""
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.waiting_utils import wait_for_logs

    port = free_port()
    container = DockerContainer(image).with_bind_ports(9092, port)
    for name, value in kraft_env(port).items():
        container = container.with_env(name, value)
    with container:
        wait_for_logs(container, STARTED, timeout=timeout_s)
        yield f"localhost:{port}"
