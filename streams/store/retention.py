"""Retention of the task store's maps: entries older than their map's `retention.*_days`,
or past its `retention.*_max` newest, leave the local copy and, with a tombstone, their
compacted topic — so a year of traffic does not grow the maps (and the topics behind
them) without bound. Dead letters leave the local copy only: their topic is not
compacted, and its own retention ages them out."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from streams.observability.metrics import Metrics
from streams.store.maps import Kind, now_ms
from streams.store.partition import StorePartition

log = logging.getLogger(__name__)

EXPIRE_CHUNK = 500  # tombstones in flight at once

Put = Callable[[Kind, int, bytes, bytes | None], Awaitable[None]]


async def expire(
    part: StorePartition,
    partition: int,
    limits: dict[str, tuple[float, int]],
    put: Put,
    metrics: Metrics,
    *,
    still: Callable[[], bool],
    now: int | None = None,
) -> dict[Kind, int]:
    """Delete `partition`'s entries past their map's limit (`limits`: map name -> days,
    max entries; `put` writes a tombstone). An entry written again meanwhile stays; the
    round stops once `still()` says the partition is no longer this worker's. How many
    went, per map."""
    now = now_ms() if now is None else now
    gone: dict[Kind, int] = {}
    for name, (days, keep) in limits.items():
        kind = Kind(name)
        before = now - int(days * 86_400_000) if days else None
        gone[kind] = 0
        chunk: list[tuple[int, bytes]] = []
        for entry in part.maps.expired(kind, before, keep or None):
            chunk.append(entry)
            if len(chunk) >= EXPIRE_CHUNK:
                gone[kind] += await _expire_chunk(kind, partition, part, chunk, put)
                chunk = []
            if not still():
                return gone  # revoked meanwhile
        gone[kind] += await _expire_chunk(kind, partition, part, chunk, put)
        metrics.store_expired.labels(kind.value).inc(gone[kind])
    if any(gone.values()):
        log.info("partition %d: expired %s", partition,
                 {k.value: n for k, n in gone.items() if n})  # fmt: skip
    return gone


async def _expire_chunk(
    kind: Kind, partition: int, part: StorePartition, chunk: list[tuple[int, bytes]], put: Put
) -> int:
    async def one(at: int, key: bytes) -> bool:
        # Checked and begun with no await between: a write of the key that starts
        # after this check goes after the tombstone.
        if part.maps.settled_at(kind, key) != at or part.positions[kind].writing(key):
            return False  # written again meanwhile: not that old any more
        if kind is Kind.DEAD_LETTERS:
            part.maps.stage(kind, key, None, now_ms())
        else:
            await put(kind, partition, key, None)
        return True

    done = await asyncio.gather(*(one(at, key) for at, key in chunk), return_exceptions=True)
    failed = [d for d in done if isinstance(d, BaseException)]
    if failed:
        log.warning("%d tombstone(s) of %s in partition %d failed (next round): %r",
                    len(failed), kind.value, partition, failed[0])  # fmt: skip
    return sum(1 for d in done if d is True)


__all__ = ["EXPIRE_CHUNK", "expire"]
