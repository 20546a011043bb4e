"""The worker's refresh of its drift baselines (at start and every `drift.refresh_s`):
a refresh that cannot read the topic keeps the baselines held, and the next one reads."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError

from streams.core.drift import DriftMonitor, Profile
from streams.settings import load_settings
from streams.store import baselines as kafka_drift


async def test_a_refresh_with_the_broker_away_keeps_the_baselines_held(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    stored = {("comment-analysis", "v1"): Profile()}
    reads: list[Any] = [stored, KafkaConnectionError("Unable to bootstrap"), {}]

    async def load(settings: Any, follower: Any = None) -> dict[tuple[str, str], Profile]:
        got = reads.pop(0)
        if isinstance(got, Exception):
            raise got
        return dict(got)

    monkeypatch.setattr(kafka_drift, "load_baselines", load)
    settings, drift = load_settings(), DriftMonitor({}, 100)
    await kafka_drift.refresh_baselines(settings, drift)
    assert drift.baselines == stored
    with caplog.at_level(logging.WARNING, logger="streams.store.baselines"):
        await kafka_drift.refresh_baselines(settings, drift)  # the broker is away
    assert drift.baselines == stored  # kept, not emptied
    assert "could not read the drift baselines (keeping the 1 held)" in caplog.text
    assert "Unable to bootstrap" in caplog.text
    await kafka_drift.refresh_baselines(settings, drift)  # back: an operator removed it
    assert drift.baselines == {}


async def test_one_unreadable_baseline_is_skipped_not_the_others() -> None:
    """A stored baseline that is no profile (a hand edit, another version's shape) is
    skipped with a warning; the others are read (before, its AttributeError or
    OverflowError made every refresh keep the old baselines, new ones never read)."""
    from tests.unit.store.test_budgets import Stored

    settings = load_settings()
    good = {"pipeline": "p", "version": "v1", "profile": Profile(answers=3).to_json()}
    follower = Stored({kafka_drift.drift_baselines_topic(settings): {
        b"p/v1": good,
        b"p/v2": {"pipeline": "p", "version": "v2", "profile": ["not", "a", "profile"]},
        b"p/v3": {"pipeline": "p", "version": "v3", "profile": {"answers": float("inf")}},
        b"p/v4": {"pipeline": "p", "version": "v4", "profile": {"counts": {"label": [1]}}},
    }})  # fmt: skip
    found = await kafka_drift.load_baselines(settings, follower)  # type: ignore[arg-type]
    assert list(found) == [("p", "v1")] and found[("p", "v1")].answers == 3
