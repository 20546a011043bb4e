"""The stop watchdog: what it tells when a stop begins."""

from __future__ import annotations

from streams.worker.shutdown import Watchdog


def test_a_stop_is_told_once_however_often_it_is_asked() -> None:
    """A signal and then a failed write both start the stop: the agent hears of it once
    (it stops starting records then), and the grace runs from the first."""
    told: list[str] = []
    watchdog = Watchdog(3600, lambda: "")
    watchdog.on_start.append(lambda: told.append("stop"))
    try:
        assert watchdog.remaining() == 3600  # no stop yet: all of the grace
        assert watchdog.for_tasks() == 3600 - 3.0  # less the margin to close the clients
        watchdog.start("signal SIGTERM")
        first = watchdog.started_at
        watchdog.start("crash: cannot write")
        assert told == ["stop"]
        assert watchdog.started_at == first
        assert 3590 < watchdog.remaining() <= 3600
    finally:
        watchdog.cancel()
