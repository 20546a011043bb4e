"""Every use of Faust's (and its aiokafka consumer's) private attributes, in one place.

faust-streaming 0.15.3 offers no public way to do these; each is pinned by the
tests that exercise it (exactly-once commits, lag on /metrics, the rejoin after a
fence), so an upgrade that moves one fails there, not in production.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

Commit = Callable[[Mapping[Any, int]], Awaitable[bool]]


def route_commits(consumer: Any, commit: Commit) -> None:
    """Faust calls `consumer._commit(offsets)` with the offsets it found safe to commit;
    send them to `commit` instead (exactly-once: into the partitions' transactions)."""
    if getattr(consumer, "_llm_streams_commit", False):
        return
    consumer._commit = commit
    consumer._llm_streams_commit = True


def committed_offsets(consumer: Any) -> Mapping[Any, int]:
    """The offsets Faust last committed (or counted as committed), per TP."""
    found: Mapping[Any, int] = getattr(consumer, "_committed_offset", {})
    return found


def paused_partitions(consumer: Any) -> int:
    """Partitions whose fetching Faust paused because their stream buffer filled."""
    return len(getattr(consumer, "_buffered_partitions", ()))


def request_rejoin(consumer: Any) -> None:
    """Make the group member rejoin (eager: every partition is revoked and assigned
    again, and Faust seeks the assigned ones back to their committed offsets), the way
    Kafka Streams enforces a rebalance after a task's producer was fenced. The
    aiokafka consumer runs in Faust's consumer thread: the request is handed to its loop."""
    thread = consumer._thread
    coordinator = thread._ensure_consumer()._coordinator
    thread.thread_loop.call_soon_threadsafe(coordinator.request_rejoin)


def kafka_producer(producer: Any) -> Any:
    """The aiokafka producer under Faust's producer, or None before Faust started it."""
    return producer._producer


def drain_passively(stream: Any) -> None:
    """Make `stream` consume its channel in the background (its processors then see every
    event), as Faust's own take does (`Stream._enable_passive`)."""
    stream._enable_passive(aiter(stream.channel))


def remove_processor(stream: Any, processor: Callable[..., Any]) -> None:
    """Undo `stream.add_processor(processor)` (Faust has no public way)."""
    stream._processors.remove(processor)


def forget_unacked(consumer: Any, messages: Iterable[Any] | None = None) -> int:
    """Stop Faust's stop from waiting for records taken and never to be acked by this
    worker (its `wait_empty` waits, with no bound, for every record taken from the
    stream): `messages`, or every one not acked. Their offsets stay uncommitted: the
    next owner of the partition runs them. Returns how many were forgotten."""
    unacked = consumer._unacked_messages
    gone = [m for m in (list(unacked) if messages is None else messages) if not m.acked]
    for message in gone:
        unacked.discard(message)
    return len(gone)
