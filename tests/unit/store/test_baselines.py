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
