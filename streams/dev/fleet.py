"""A simulated group of workers sharing one provider key, for `bench/fleet.py` and the
limiter's tests: each worker the worker's own call path (`GuardedClient`, its
`RateLimiter` never told the limit, its breaker) with callers that retry as a task does,
against one key's limits (`streams.dev.sim_limits`) in a given shape. Time is the
loop's: run it under `virtual_time()` (aiotools' `VirtualClock`) and minutes pass in
seconds, with nothing else competing for the CPU."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from unittest import mock

import aiotools

from streams.dev.sim_limits import SimLimits
from streams.errors import RateLimited
from streams.llm.client import LLMRequest, LLMResponse
from streams.resilience.breaker import CircuitBreaker
from streams.resilience.clock import MonotonicClock
from streams.resilience.guarded import GuardedClient
from streams.resilience.limiter import GroupShare, RateLimiter
from streams.resilience.retry import RetryPolicy

RTT_S = 0.02
WARM_UP_S = 60.0


@contextlib.contextmanager
def virtual_time() -> Iterator[None]:
    """The running loop on aiotools' virtual clock, with the real loop's timer
    resolution. The virtual clock makes the loop run every timer due within 1 ms at
    once without moving its time there, so a limiter sleeping 0.09 ms until its next
    grant woke at the same instant for ever."""
    loop = asyncio.get_running_loop()
    with aiotools.VirtualClock().patch_loop(), mock.patch.object(loop, "_clock_resolution", 1e-9):
        yield


class LoopClock(MonotonicClock):
    """The limiter's and breaker's clock on the loop's time (virtual under a virtual
    clock, which patches the loop's time and not `time.monotonic`)."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()


@dataclass
class Shape:
    limit_shape: str = "bucket"
    remaining_window_s: float = 60.0
    headers: bool = True
    rpm: int = 3000
    tpm: int = 0
    burst_s: float = 1.0
    window_s: float = 60.0
    header_style: str = "openai"  # a fake clock's resets: OpenAI's relative ones only


SHAPES = {
    "minute": Shape(),
    "second": Shape(remaining_window_s=1.0),
    "window": Shape(limit_shape="window"),
    "none": Shape(headers=False),
}


@dataclass
class Provider:
    """One key's limits, shared by every worker's client."""

    shape: Shape
    rng: random.Random
    limits: SimLimits = field(init=False)
    admitted: list[float] = field(default_factory=list)
    refused: int = 0
    dead_letters: int = 0

    def __post_init__(self) -> None:
        self.limits = SimLimits(self.shape.window_s, now=lambda: asyncio.get_running_loop().time())


class Client:
    """A worker's connection to the provider (an `LLMClient`)."""

    endpoint = "sim"

    def __init__(self, provider: Provider) -> None:
        self.provider = provider

    async def complete(self, request: LLMRequest) -> LLMResponse:
        p = self.provider
        await asyncio.sleep(RTT_S / 2)
        limited = p.limits.admit(p.shape, 0)
        headers = p.limits.headers(p.shape) if p.shape.headers else {}
        if limited is not None:
            p.refused += 1
            await asyncio.sleep(RTT_S / 2)
            wait = max(0.001, limited[0])
            raise RateLimited("429 rate limit reached", retry_after=wait,
                              headers=headers or None)  # fmt: skip
        p.admitted.append(asyncio.get_running_loop().time())
        await asyncio.sleep(0.3 + p.rng.uniform(-0.1, 0.1))
        return LLMResponse(content="{}", model=request.model, prompt_tokens=50,
                           completion_tokens=10, finish_reason="stop",
                           rate_headers=headers)  # fmt: skip

    async def close(self) -> None:
        return None


async def caller(guarded: GuardedClient, until: float, provider: Provider) -> None:
    """Tasks one after another, each retried as the worker retries a task's call
    (`RetryPolicy`: backoff with jitter, Retry-After when longer, at most 4 attempts;
    then the task is a dead letter)."""
    loop = asyncio.get_running_loop()
    policy = RetryPolicy()
    request = LLMRequest(messages=[{"role": "user", "content": "hi"}], model="sim-1")
    while loop.time() < until:
        for attempt in range(1, policy.max_attempts + 1):
            try:
                await guarded.complete(request)
                break
            except RateLimited as exc:
                if attempt == policy.max_attempts:
                    provider.dead_letters += 1
                    break
                await asyncio.sleep(policy.wait_after(attempt, exc, provider.rng))


async def run_group(workers: int, shape: Shape, minutes: float, concurrency: int,
                    seed: int) -> tuple[float, float, int]:  # fmt: skip
    """(admitted per minute after the warm-up / the limit, refused share of all calls,
    tasks that ran out of attempts)."""
    clock = LoopClock()
    provider = Provider(shape, random.Random(seed))
    loop = asyncio.get_running_loop()
    start = loop.time()
    until = start + minutes * 60
    rng = random.Random(seed + 1)
    tasks = []
    for _ in range(workers):
        group = GroupShare()
        group.assigned(1, workers)
        guarded = GuardedClient(
            Client(provider), clock=clock,
            limiter=RateLimiter(rpm=None, clock=clock, group=group),
            breaker=CircuitBreaker("sim", clock=clock),
        )  # fmt: skip

        async def worker(g: GuardedClient = guarded, delay: float = rng.uniform(0, 2)) -> None:
            await asyncio.sleep(delay)  # workers do not start in the same millisecond
            await asyncio.gather(*(caller(g, until, provider) for _ in range(concurrency)))

        tasks.append(asyncio.ensure_future(worker()))
    await asyncio.gather(*tasks)
    steady = [t for t in provider.admitted if start + WARM_UP_S <= t < until]
    per_minute = len(steady) / ((until - start - WARM_UP_S) / 60)
    calls = len(provider.admitted) + provider.refused
    return per_minute / shape.rpm, provider.refused / max(1, calls), provider.dead_letters


__all__ = ["SHAPES", "LoopClock", "Provider", "Shape", "run_group", "virtual_time"]
