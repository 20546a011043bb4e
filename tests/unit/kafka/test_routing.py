"""The partition a task id maps to is the one Kafka's default partitioner picks."""

from __future__ import annotations

import uuid

from aiokafka.partitioner import DefaultPartitioner

from streams.kafka.routing import partition_for


def test_a_task_id_maps_where_a_producer_keyed_by_it_sends_it() -> None:
    partitioner = DefaultPartitioner()
    for n in (1, 4, 12):
        for i in range(500):
            task_id = f"{uuid.UUID(int=i * 7919)}-中文-{i}"
            picked = partitioner(task_id.encode(), list(range(n)), list(range(n)))
            assert partition_for(task_id, n) == picked
