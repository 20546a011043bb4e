"""On the demo broker, Tansu (the embedded broker of `llm-streams demo`; no transactions,
and its listed end of a partition can be short of the real one: it answers the base
offset + 1 of the last batch): a scan still reads every record (the read-to-end rule of
`streams.kafka.scan`), and a worker asked for exactly-once is refused clearly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from streams.dev.brokers.tansu import TansuBroker
from streams.kafka.scan import scan
from streams.settings import load_settings

pytestmark = pytest.mark.integration

RECORDS = 2000


async def test_a_scan_reads_to_the_real_end_where_the_listed_end_is_short(
    tmp_path: Path,
) -> None:
    with TansuBroker(log_file=tmp_path / "tansu.log") as broker:
        settings = load_settings(kafka={"broker_url": broker.url, "session_timeout_s": 6})
        topic = "history"
        producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap, linger_ms=50)
        await producer.start()
        try:  # many records per batch: the shape Tansu lists short
            sent = [await producer.send(topic, key=f"k{i}".encode(), value=b"v", partition=0)
                    for i in range(RECORDS)]  # fmt: skip
            for fut in sent:
                await fut
        finally:
            await producer.stop()
        consumer = AIOKafkaConsumer(bootstrap_servers=broker.bootstrap)
        await consumer.start()
        try:
            tp = TopicPartition(topic, 0)
            listed = (await consumer.end_offsets([tp]))[tp]
        finally:
            await consumer.stop()
        read = [r async for batch in scan(settings, topic) for r in batch]
    assert listed < RECORDS  # the broker's listing really is short here
    assert len(read) == RECORDS and read[-1].offset == RECORDS - 1


def test_exactly_once_on_a_broker_without_transactions_is_refused_clearly(
    tmp_path: Path,
) -> None:
    with TansuBroker(log_file=tmp_path / "tansu.log") as broker:  # no transactions
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
               "LLM_STREAMS_PROCESSING_GUARANTEE": "exactly_once",
               "LLM_STREAMS_KAFKA__BROKER_URL": broker.url,
               "LLM_STREAMS_DATA_DIR": str(tmp_path)}  # fmt: skip
        done = subprocess.run([sys.executable, "-m", "streams.cli", "worker"], env=env,
                              capture_output=True, timeout=90, text=True)  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert "exactly_once needs a Kafka broker with transactions" in done.stderr
    assert "at_least_once" in done.stderr
