"""A bound on how long a stopping worker takes, whatever it waits for.

Faust's stop waits for every record taken from the stream to be acknowledged
("Wait for streams…", no timeout), and its Kafka clients retry while the
broker is away: with the broker or the LLM endpoint gone during a rollout, a
worker told to stop could wait for minutes until something kills it. Once a
stop begins (SIGTERM / SIGINT, or the worker stopping itself because it
cannot write), the watchdog — a thread, so a blocked event loop cannot hold
it — gives the stop `shutdown_grace_s`; then it logs what is left behind and
ends the process. What is left is unacknowledged, so the next owner of those
partitions processes it again under the same result keys.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

# Of the grace, what the stop keeps after its tasks to close the clients and commit: the
# started tasks get the rest (`Watchdog.for_tasks`).
CLOSE_MARGIN_S = 3.0


class Watchdog:
    """Ends the process `grace_s` after `start()`, saying what `report()` says is left."""

    def __init__(self, grace_s: float, report: Callable[[], str]) -> None:
        self.grace_s = grace_s
        self.report = report
        self.started_at: float | None = None
        self._why = ""
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        self.on_start: list[Callable[[], None]] = []  # told once, when a stop begins

    def start(self, why: str) -> None:
        """A stop has begun (idempotent: the first reason counts)."""
        with self._lock:
            if self._timer is not None:
                return
            self.started_at = time.monotonic()
            self._why = why
            self._timer = threading.Timer(self.grace_s, self._expire)
            self._timer.daemon = True
            self._timer.start()
        log.info("stopping (%s): in-flight tasks get %.0fs to finish", why, self.grace_s)
        for begun in self.on_start:
            begun()

    def remaining(self) -> float:
        """Seconds left of the grace (all of it when no stop has begun)."""
        if self.started_at is None:
            return self.grace_s
        return max(0.0, self.grace_s - (time.monotonic() - self.started_at))

    def for_tasks(self) -> float:
        """What the started tasks may still take: the grace left, less `CLOSE_MARGIN_S`."""
        return max(0.0, self.remaining() - CLOSE_MARGIN_S)

    def cancel(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()

    def _expire(self) -> None:
        try:
            left = self.report()
        except Exception as exc:  # reading another thread's state: never fail the exit
            left = f"(could not tell: {exc!r})"
        log.critical("stopped after the %.0fs shutdown grace (%s); left unacknowledged for the "
                     "next owner: %s", self.grace_s, self._why, left)  # fmt: skip
        for handler in logging.getLogger().handlers:
            with contextlib.suppress(Exception):  # a closed stream: nothing more to say
                handler.flush()
        sys.stderr.flush()
        os._exit(0 if self._why.startswith("signal") else 1)
