"""A bare aiokafka pass-through (A -> B) on one event loop, no Faust: the second floor
of bench/cpu_per_task.py.

Run as `python bench/passthrough_aiokafka.py` with BENCH_BOOTSTRAP, BENCH_SOURCE,
BENCH_SINK, BENCH_APP_ID in the environment. A consumer group member fetches on
the worker's event loop (uvloop, as the worker), writes each record on and awaits
the broker's ack (as the worker does), and commits what it wrote every 2.8 s (Faust's
default commit interval). Set beside the Faust pass-through, it shows what Faust's
consumer (its thread, its per-record dispatch) costs per record.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

COMMIT_EVERY_S = 2.8


async def main() -> None:
    bootstrap = os.environ["BENCH_BOOTSTRAP"]
    sink = os.environ["BENCH_SINK"]
    consumer = AIOKafkaConsumer(
        os.environ["BENCH_SOURCE"], bootstrap_servers=bootstrap,
        group_id=os.environ["BENCH_APP_ID"], enable_auto_commit=False,
        auto_offset_reset="earliest",
    )  # fmt: skip
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stopping.set)
    loop.add_signal_handler(signal.SIGINT, stopping.set)
    await consumer.start()
    await producer.start()
    done: dict[TopicPartition, int] = {}
    committed_at = time.monotonic()
    try:
        while not stopping.is_set():
            batches = await consumer.getmany(timeout_ms=1000)
            for tp, records in batches.items():
                for record in records:
                    await (await producer.send(sink, record.value, key=record.key))
                    done[tp] = record.offset + 1
            if done and time.monotonic() - committed_at >= COMMIT_EVERY_S:
                await consumer.commit(dict(done))
                done.clear()
                committed_at = time.monotonic()
    finally:
        await producer.stop()
        await consumer.stop()


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from streams.worker.run import _new_loop

    loop = _new_loop()
    asyncio.set_event_loop(loop)
    loop.run_until_complete(main())
