"""Start a Faust worker for the app built from settings."""

from __future__ import annotations

import asyncio
import logging

import faust

from streams.settings import Settings

log = logging.getLogger(__name__)


def run_worker(settings: Settings) -> None:
    from streams.app import create_app

    if settings.processing_guarantee == "exactly_once":
        log.warning(
            "processing_guarantee=exactly_once needs a broker with transactions (Apache Kafka, "
            "Redpanda); Tansu has none and the worker will stop at start there"
        )
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    app = create_app(settings)
    worker = faust.Worker(app, loop=loop, loglevel=settings.log_level)
    worker.execute_from_commandline()
