"""Drift baselines on Kafka: `<app_id>-drift-baselines`, compacted, one record per
`pipeline/version` holding its `core.drift.Profile`. `llm-streams drift --save-baseline`
writes them; every worker reads them at start and every `drift.refresh_s`."""

from __future__ import annotations

import logging
from typing import Any

import orjson

from streams.contract.records import now_iso
from streams.core.drift import DriftMonitor, Profile, baseline_key
from streams.kafka import clients
from streams.kafka.scan import Follower, latest_of
from streams.kafka.topics import drift_baselines_topic, ensure_topics
from streams.settings import Settings

log = logging.getLogger(__name__)


async def load_baselines(
    settings: Settings, follower: Follower | None = None
) -> dict[tuple[str, str], Profile]:
    """The stored baselines (none when the topic does not exist yet). `follower`: the
    worker's reader of the topic (else it is read whole)."""
    out: dict[tuple[str, str], Profile] = {}
    for value in (await latest_of(settings, drift_baselines_topic(settings), follower)).values():
        try:
            key = (str(value["pipeline"]), str(value["version"]))
            out[key] = Profile.from_json(value["profile"])
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            log.warning("skipping an unreadable drift baseline: %r", exc)  # not the others
    return out


async def refresh_baselines(
    settings: Settings, drift: DriftMonitor, follower: Follower | None = None
) -> None:
    """The stored baselines read again into `drift` (an operator may have set one). While
    the topic cannot be read (the broker away), `drift` keeps the ones it holds and the
    next refresh tries again."""
    try:
        drift.baselines = await load_baselines(settings, follower)
    except Exception as exc:
        log.warning("could not read the drift baselines (keeping the %d held): %r",
                    len(drift.baselines), exc)  # fmt: skip


async def save_baseline(
    settings: Settings, pipeline: str, version: str, profile: Profile, chosen: str
) -> dict[str, Any]:
    """Store `profile` as the baseline of `pipeline/version` (acks=all); `chosen` says
    what it was taken from. Returns the record written."""
    topic = drift_baselines_topic(settings)
    await ensure_topics(settings, [topic])
    record = {"pipeline": pipeline, "version": version, "chosen": chosen, "at": now_iso(),
              "profile": profile.to_json()}  # fmt: skip
    producer = clients.producer(settings, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(
            topic, orjson.dumps(record), key=baseline_key(pipeline, version)
        )
    finally:
        await producer.stop()
    return record


__all__ = ["load_baselines", "refresh_baselines", "save_baseline"]
