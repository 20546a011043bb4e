"""CPU per grant of the rate limiter holding a backlog, against one bare loop timer per grant.

A backlog of N waiters held by the limit (`--rate` grants a second, a burst of one)
wakes the limiter's pump once per grant. The floor, measured in the same run: the
same number of callers paced by one loop timer each, at the same rate — what a
wake-up that can proceed costs with nothing else around it. Printed: CPU
microseconds per grant for both, and their ratio (process CPU, uvloop).

    python bench/limiter_grants.py [--grants 2000] [--rate 1000] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import uvloop

from streams.contract.lanes import Lane
from streams.resilience.limiter import RateLimiter


async def limiter_grants(grants: int, rate: float) -> float:
    """CPU seconds per grant for a backlog of `grants` waiters held at `rate` per second."""
    limiter = RateLimiter(rpm=rate * 60, burst_s=1 / rate, headroom=0.0, safety=1.0)
    started = time.process_time()
    await asyncio.gather(*(limiter.acquire(0, Lane.REPLAY) for _ in range(grants)))
    return (time.process_time() - started) / grants


async def timer_grants(grants: int, rate: float) -> float:
    """CPU seconds per wake-up of `grants` callers let go one by one, one timer each."""
    loop = asyncio.get_running_loop()
    started = time.process_time()
    begin = loop.time()
    for i in range(grants):
        woken = loop.create_future()
        loop.call_at(begin + i / rate, woken.set_result, None)
        await woken
    return (time.process_time() - started) / grants


async def main(args: argparse.Namespace) -> None:
    print(f"backlog of {args.grants} held at {args.rate:g} grants/s; CPU per grant")
    print(f"{'run':>4} {'limiter us':>11} {'one timer us':>13} {'ratio':>6}")
    for run in range(1, args.runs + 1):
        limited = await limiter_grants(args.grants, args.rate)
        floor = await timer_grants(args.grants, args.rate)
        print(f"{run:>4} {limited * 1e6:>11.1f} {floor * 1e6:>13.1f} {limited / floor:>6.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grants", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--runs", type=int, default=3)
    uvloop.run(main(parser.parse_args()))
