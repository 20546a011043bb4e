"""A group of N workers sharing one provider key, in simulated time: how much of the key's
limit the group turns into answers, and what share of its calls the provider refuses.

Each simulated worker has the worker's own call path: a `GuardedClient` with the
worker's `RateLimiter`, which is never told the limit and learns it from the answers
(headers, or 429s where none come). It claims the worker's `GroupShare` of the group,
1/N, as a worker owning 1/N of the partitions does. Each worker has `--concurrency`
callers. A caller refused with a 429 retries as a task does (`RetryPolicy`: backoff with jitter,
`Retry-After` when longer, at most 4 attempts). The provider is the simulator's rate limits (`streams.dev.sim_limits`), one key
shared by all, in one of several shapes:

- `minute`: RPM refilled per second with a one-second burst, `remaining` counted against
  the minute (OpenAI's headers);
- `second`: the same limit, `remaining` counted against the enforcing second (some
  gateways);
- `window`: a fixed one-minute window, reset at each minute's end;
- `none`: the `minute` bucket, but no `x-ratelimit-*` headers at all, only 429s with
  `Retry-After`.

An answer takes 300 +- 100 ms (uniform), a 429 20 ms. Time is virtual (aiotools'
`VirtualClock`), so 32 workers over minutes run in seconds. Nothing else competes for the
CPU, so the figures belong to the algorithm, not to this machine. What it leaves out is
said in docs/SCALING.md: Kafka, the rebalance, and workers that own no partition.

Printed per shape and group size: admitted requests per minute over the steady span
(after the first minute) as a share of the limit, the share of calls refused, and the
tasks that ran out of attempts (dead letters, `rate_limited`).

    python bench/fleet.py [--workers 1,2,4,8,16,32] [--shapes minute,second,window,none]
                          [--rpm 3000] [--minutes 5] [--concurrency 64] [--seed 1]
"""

from __future__ import annotations

import argparse
import asyncio

from streams.dev.fleet import SHAPES, WARM_UP_S, Shape, run_group, virtual_time


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="1,2,4,8,16,32")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rpm", type=int, default=3000)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    counts = [int(n) for n in args.workers.split(",")]
    print(f"one key at {args.rpm} RPM, {args.minutes:g} simulated minutes per run, "
          f"{args.concurrency} callers per worker, steady span after {WARM_UP_S:.0f} s")  # fmt: skip
    print(f"{'shape':<8}" + "".join(f"{f'{n} worker' + ('s' if n > 1 else ''):>24}"
                                    for n in counts))  # fmt: skip
    print(f"{'':<8}" + "".join(f"{'limit / 429s / DL':>24}" for _ in counts))
    for name in args.shapes.split(","):
        shape = Shape(**{**SHAPES[name].__dict__, "rpm": args.rpm})
        cells = []
        for n in counts:
            with virtual_time():
                used, refused, dead = await run_group(n, shape, args.minutes,
                                                      args.concurrency, args.seed)  # fmt: skip
            cells.append(f"{used:.3f} / {refused:.2%} / {dead}")
        print(f"{name:<8}" + "".join(f"{c:>24}" for c in cells), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
