"""A bare Faust pass-through agent (A -> B), the baseline of bench/pipeline_overhead.py.

Run as `python bench/passthrough_app.py` with BENCH_BROKER, BENCH_SOURCE,
BENCH_SINK, BENCH_APP_ID, BENCH_WEB_PORT in the environment (BENCH_ACKED=1: each
record's write is awaited until the broker acks it, as the worker does; BENCH_IN_LOOP=1:
Faust's consumer runs on the app's loop, as the worker's does). It starts the
worker exactly as `llm-streams worker` does (same event loop, no spinner), so
the ratio measures the pipeline, not worker set-up differences.

BENCH_TASK_IO=1 (with BENCH_LLM_URL, BENCH_LLM_KEY and BENCH_STATE) makes it do a
task's I/O and nothing else: per record, in a task of its own, one chat completion
(aiohttp, the body and headers of a one-comment prompt, the answer parsed), then two
acked writes one after the other through the aiokafka producer under Faust's, as the
worker writes (the record to BENCH_SINK for its result, a small state to BENCH_STATE).
What the worker's stack costs per task before any of the worker's own work: no
decoding, prompt, limiter, breaker, span, metric or store.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import aiohttp
import faust
import orjson

from streams.worker.app import PRODUCER_LINGER_S, InLoopApp
from streams.worker.faust_private import kafka_producer

IN_LOOP = os.environ.get("BENCH_IN_LOOP") == "1"
app = (InLoopApp if IN_LOOP else faust.App)(
    os.environ["BENCH_APP_ID"],
    broker=os.environ["BENCH_BROKER"],
    store="memory://",
    topic_disable_leader=True,
    producer_linger=PRODUCER_LINGER_S,  # the worker's
    web_port=int(os.environ["BENCH_WEB_PORT"]),
    web_bind="127.0.0.1",
    autodiscover=False,
)
raw = {"key_serializer": "raw", "value_serializer": "raw", "internal": True}
source = app.topic(os.environ["BENCH_SOURCE"], **raw)
sink = app.topic(os.environ["BENCH_SINK"], **raw)


ACKED = os.environ.get("BENCH_ACKED") == "1"
TASK_IO = os.environ.get("BENCH_TASK_IO") == "1"


class TaskIO:
    """A task's I/O alone: one chat completion, then the result and the state written,
    each acked before the next (the worker's order)."""

    def __init__(self) -> None:
        self.url = os.environ["BENCH_LLM_URL"]
        self.sink, self.state = os.environ["BENCH_SINK"], os.environ["BENCH_STATE"]
        self.headers = {"Authorization": f"Bearer {os.environ['BENCH_LLM_KEY']}",
                        "Content-Type": "application/json"}  # fmt: skip
        self.session: aiohttp.ClientSession | None = None
        self.running: set[asyncio.Task[None]] = set()

    def start(self, key: bytes | None, value: bytes) -> None:
        task = asyncio.create_task(self.run(key, value))
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    async def run(self, key: bytes | None, value: bytes) -> None:
        if self.session is None:
            self.session = aiohttp.ClientSession(headers=self.headers)
        comment = orjson.loads(value).get("input", {}).get("text", "")
        body = orjson.dumps({"model": "sim-1", "messages": [
            {"role": "system", "content": "Classify the comment's sentiment."},
            {"role": "user", "content": comment}]})  # fmt: skip
        async with self.session.post(self.url, data=body) as response:
            answer: dict[str, Any] = orjson.loads(await response.read())
        result = orjson.dumps({"key": key and key.decode(), "answer": answer["choices"][0]})
        await self.write(self.sink, key, result)
        await self.write(self.state, key, b'{"status": "succeeded"}')

    async def write(self, topic: str, key: bytes | None, value: bytes) -> None:
        producer = await kafka_producer(app)  # as the worker writes (TaskAgent._topic_send)
        await (await producer.send(topic, value, key=key))


@app.agent(source)
async def passthrough(stream):  # type: ignore[no-untyped-def]
    io = TaskIO() if TASK_IO else None
    async for key, value in stream.items():
        if io is not None:
            io.start(key, value)
            continue
        written = await sink.send(key=key, value=value)
        if ACKED:
            await written


if __name__ == "__main__":
    import asyncio

    from streams.worker.run import _new_loop

    loop = _new_loop()
    asyncio.set_event_loop(loop)
    worker = faust.Worker(app, loop=loop, loglevel="warning")
    worker.spinner = None
    worker.execute_from_commandline()
