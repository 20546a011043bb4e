"""Lanes (which input a task came through) and tiers (how and at what price it is asked)."""

from __future__ import annotations

from enum import IntEnum, StrEnum


class Lane(IntEnum):
    """Lower value = served first (concurrency slots, the rate limiter)."""

    LIVE = 0
    REPLAY = 1


class Tier(StrEnum):
    """How a task's requests are made: a plain call, the provider's flex tier, or a line
    in a Batch API batch (flex and batch at the batch price)."""

    SYNC = "sync"
    FLEX = "flex"
    BATCH = "batch"
