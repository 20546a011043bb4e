"""Which partition a task belongs to, as every producer of the task topics keys it.

The task store is co-partitioned with the task topics: a task's answers live
in the partition its task id maps to under Kafka's default partitioner
(murmur2 of the key, as aiokafka and the Java client compute it). A record
keyed otherwise, or sent to another partition by a producer's own
partitioner, is forwarded by the worker to its task's partition (with the
`llm-streams-rerouted-from` header) and answered there, so one result key
never lands on two partitions.
"""

from __future__ import annotations

from aiokafka.partitioner import murmur2


def task_key(task_id: str, session_id: str | None = None) -> bytes:
    """The key a task's record goes under: its session's id when it is a turn of one (a
    session's turns stay in order on one partition), else its own."""
    return (session_id or task_id).encode()


def partition_for(task_id: str, partitions: int) -> int:
    """The partition Kafka's default partitioner gives a record keyed by `task_id`."""
    return partition_of(task_id.encode(), partitions)


def partition_of(key: bytes, partitions: int) -> int:
    """The partition Kafka's default partitioner gives a record keyed by `key`."""
    return int(murmur2(key) & 0x7FFFFFFF) % partitions
