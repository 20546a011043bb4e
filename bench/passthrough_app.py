"""A bare Faust pass-through agent (A -> B), the baseline of bench/pipeline_overhead.py.

Run as `python bench/passthrough_app.py` with BENCH_BROKER, BENCH_SOURCE,
BENCH_SINK, BENCH_APP_ID, BENCH_WEB_PORT in the environment (BENCH_ACKED=1: each
record's write is awaited until the broker acks it, as the worker does; BENCH_IN_LOOP=1:
Faust's consumer runs on the app's loop, as the worker's does). It starts the
worker exactly as `llm-streams worker` does (same event loop, no spinner), so
the ratio measures the pipeline, not worker set-up differences.
"""

from __future__ import annotations

import os

import faust

from streams.kafka.app import InLoopApp

IN_LOOP = os.environ.get("BENCH_IN_LOOP") == "1"
app = (InLoopApp if IN_LOOP else faust.App)(
    os.environ["BENCH_APP_ID"],
    broker=os.environ["BENCH_BROKER"],
    store="memory://",
    topic_disable_leader=True,
    producer_linger=0.005,
    web_port=int(os.environ["BENCH_WEB_PORT"]),
    web_bind="127.0.0.1",
    autodiscover=False,
)
raw = {"key_serializer": "raw", "value_serializer": "raw", "internal": True}
source = app.topic(os.environ["BENCH_SOURCE"], **raw)
sink = app.topic(os.environ["BENCH_SINK"], **raw)


ACKED = os.environ.get("BENCH_ACKED") == "1"


@app.agent(source)
async def passthrough(stream):  # type: ignore[no-untyped-def]
    async for key, value in stream.items():
        written = await sink.send(key=key, value=value)
        if ACKED:
            await written


if __name__ == "__main__":
    import asyncio

    from streams.kafka.worker import _new_loop

    loop = _new_loop()
    asyncio.set_event_loop(loop)
    worker = faust.Worker(app, loop=loop, loglevel="warning")
    worker.spinner = None
    worker.execute_from_commandline()
