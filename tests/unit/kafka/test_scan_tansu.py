"""On the demo broker, Tansu, whose listed end of a partition can be short of the real
one (it answers the base offset + 1 of the last batch), every scan still reads every
record: the read-to-end rule of `streams.kafka.scan`."""

from __future__ import annotations

from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from streams.dev.brokers.tansu import TansuBroker
from streams.kafka.scan import scan
from streams.settings import load_settings

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
