"""The calls an endpoint without rate limits takes at once: found from the queueing its
calls meet (the server's own timings, or the fastest rate seen), followed as it changes,
live before replay, every turn given back on every way out, and the read timeout
stretched to the server's pace."""

from __future__ import annotations

import asyncio

import pytest

from streams.contract.lanes import Lane
from streams.errors import Timeout
from streams.llm.client import LLMRequest, LLMResponse
from streams.llm.endpoint import EndpointFacts
from streams.resilience.breaker import CircuitBreaker
from streams.resilience.concurrency import START, TIMEOUT_FACTOR, ConcurrencyLimit, Served
from streams.resilience.guarded import GuardedClient
from streams.resilience.limiter import RateLimiter

SERVICE_S = 2.0


async def rounds(gate: ConcurrencyLimit, slots: int, n: int, *, timings: bool = True) -> list[int]:
    """`n` rounds of as many calls as the gate lets through at once, against a server
    working on `slots` at a time: the calls beyond its slots wait one service in its
    queue. The limit after each round."""
    seen = []
    for _ in range(n):
        turns = gate.current or 1
        for _ in range(turns):
            await gate.acquire()
        for i in range(turns):
            queued = 0.0 if i < slots else SERVICE_S * ((i - slots) // slots + 1)
            gate.release(Served(SERVICE_S + queued, 400, 150,
                                SERVICE_S if timings else None))  # fmt: skip
        seen.append(gate.current or 0)
    return seen


@pytest.mark.parametrize("slots", [1, 2, 6, 16])
async def test_the_limit_finds_the_servers_slots_and_stays_there(slots: int) -> None:
    """llama.cpp says its own time on each call: what was queueing is measured. The limit
    holds the server's slots and one or two ready to take a freed slot (the best fixed
    limit of a real 2-slot server was 3)."""
    gate = ConcurrencyLimit(max_limit=64)
    seen = await rounds(gate, slots, 40)
    assert all(slots + 1 <= limit <= slots + 2 for limit in seen[-20:]), seen


@pytest.mark.parametrize("slots", [1, 2, 6, 16])
async def test_without_the_servers_timings_the_queue_stays_within_its_slots(slots: int) -> None:
    """A server that says nothing of its time: the round's pace against the long run
    finds it, less tightly (a queue of up to its slots, each call waiting a service at
    most: no timeout, all the server can do)."""
    gate = ConcurrencyLimit(max_limit=64)
    seen = await rounds(gate, slots, 40, timings=False)
    assert all(slots <= limit <= 2 * slots + 1 for limit in seen[-15:]), seen


async def test_a_busy_server_without_a_queue_gets_every_call_it_is_given() -> None:
    """A hosted endpoint that sends no rate limits and answers with a spread of paces but
    never queues: slow start doubles the limit to the worker's own bound and it stays."""
    import random

    rng = random.Random(7)
    gate = ConcurrencyLimit(max_limit=64)
    for _ in range(30):
        turns = gate.current or 1
        for _ in range(turns):
            await gate.acquire()
        for _ in range(turns):
            gate.release(Served(rng.lognormvariate(-1.6, 0.5), 300, 100))
    assert gate.current == 64


async def test_a_server_that_says_its_slots_starts_there_and_a_timeout_cuts_the_limit() -> None:
    gate = ConcurrencyLimit(max_limit=64)
    assert gate.current == START
    gate.tell_slots(8)
    assert gate.current == 9  # its slots and one ready
    await gate.acquire()
    gate.release(Served(30.0, overloaded=True))
    assert gate.current == 6  # 9 x 0.7
    for _ in range(10):
        await gate.acquire()
        gate.release(Served(30.0, overloaded=True))
    assert gate.current == 1  # never below one


async def test_live_calls_go_before_replay_ones_and_a_cancelled_wait_frees_nothing() -> None:
    gate = ConcurrencyLimit(start=1)
    await gate.acquire()  # the one turn, taken
    order: list[str] = []

    async def call(name: str, lane: Lane) -> None:
        await gate.acquire(lane)
        order.append(name)

    replay = asyncio.create_task(call("replay", Lane.REPLAY))
    gone = asyncio.create_task(call("gone", Lane.LIVE))
    await asyncio.sleep(0)
    live = asyncio.create_task(call("live", Lane.LIVE))
    await asyncio.sleep(0)
    gone.cancel()  # cancelled while waiting: it takes and frees nothing
    await asyncio.sleep(0)
    assert gate.waiting == 2
    gate.release(None)
    await live
    assert order == ["live"] and gate.in_flight == 1
    gate.release(None)
    await replay
    assert order == ["live", "replay"]
    granted = asyncio.create_task(gate.acquire(Lane.LIVE))
    await asyncio.sleep(0)
    gate.release(None)  # the turn goes to `granted`, which is cancelled before it runs
    granted.cancel()
    with pytest.raises(asyncio.CancelledError):
        await granted
    assert gate.in_flight == 0  # its turn passed on, not held for ever


async def test_an_endpoint_with_rate_limits_is_not_limited_here() -> None:
    gate = ConcurrencyLimit(start=1)
    changes: list[int | None] = []
    gate.on_change = changes.append
    await gate.acquire()
    waiting = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0)
    assert not waiting.done()
    gate.open()  # its first answer carried x-ratelimit headers
    await waiting
    assert gate.current is None and changes == [None] and gate.in_flight == 2


async def test_the_read_timeout_stretches_to_the_servers_pace() -> None:
    gate = ConcurrencyLimit()
    assert gate.timeout_for(30.0, 5000, 400) == 30.0  # nothing seen yet: the setting
    for _ in range(5):
        await gate.acquire()
        gate.release(Served(20.0, 600, 200, 20.0))  # a slow CPU: 20 s for 275 units
    long = gate.timeout_for(30.0, 4500, 400)  # a long prompt: ~960 units
    assert long > 4 * 20.0 * (960 / 276) * 0.95
    assert gate.timeout_for(30.0, 10, 5) == 30.0  # a short one: the setting


async def test_the_read_timeout_covers_the_wait_for_a_slot_behind_the_calls_out() -> None:
    """The gate lets one or two calls more than the server's slots out (they wait there
    for a slot): their read timeout counts the services ahead of them, so a call queued
    at a busy server is not timed out while the server is about to work on it."""
    gate = ConcurrencyLimit()
    gate.tell_slots(2)
    for _ in range(5):
        await gate.acquire()
        gate.release(Served(2.0, 100, 40, 2.0))  # 2 s for ~53 units
    await gate.acquire()
    alone = gate.timeout_for(4.0, 100, 40)  # one call out: a slot is free
    assert alone > 4.0
    for _ in range(2):  # three out (its limit): the third waits for a slot at the server
        await gate.acquire()
    assert gate.in_flight == 3
    assert gate.timeout_for(4.0, 100, 40) == pytest.approx(2 * alone)
    # A server that does not say its slots: the limit less the one it holds ready.
    quiet = ConcurrencyLimit(start=3)
    await quiet.acquire()
    quiet.release(Served(2.0, 100, 40, 2.0))
    await quiet.acquire()
    assert quiet.timeout_for(4.0, 100, 40) == pytest.approx(TIMEOUT_FACTOR * 2.0)  # a slot free
    for _ in range(2):
        await quiet.acquire()
    assert quiet.timeout_for(4.0, 100, 40) == pytest.approx(2 * TIMEOUT_FACTOR * 2.0)


class SlotServer:
    """An LLM client whose server works on `slots` requests at a time, `service_s` each,
    queueing the rest; it says its slots and its timings, as llama.cpp does."""

    endpoint = "fake://slots"

    def __init__(self, slots: int, service_s: float) -> None:
        self.slots = asyncio.Semaphore(slots)
        self.n = slots
        self.service_s = service_s
        self.at_once = 0
        self.most_at_once = 0  # requests at the server (working or queued), at most

    async def describe(self, model: str) -> EndpointFacts:
        return EndpointFacts(server="llama.cpp", slots=self.n)

    async def complete(self, request: LLMRequest) -> LLMResponse:
        self.at_once += 1
        self.most_at_once = max(self.most_at_once, self.at_once)
        try:
            async with self.slots:
                await asyncio.sleep(self.service_s)
        finally:
            self.at_once -= 1
        return LLMResponse(content="{}", model="m", prompt_tokens=100, completion_tokens=20,
                           finish_reason="stop", server_s=self.service_s)  # fmt: skip

    async def close(self) -> None:
        return None


async def test_a_guarded_client_keeps_a_saturated_servers_queue_short() -> None:
    server = SlotServer(slots=2, service_s=0.1)
    gate = ConcurrencyLimit(max_limit=64)
    guarded = GuardedClient(server, limiter=RateLimiter(rpm=1_000_000),
                            breaker=CircuitBreaker("s"), concurrency=gate)  # fmt: skip
    await guarded.describe("m")
    request = LLMRequest(messages=[{"role": "user", "content": "hi"}], model="m")
    await asyncio.gather(*(guarded.complete(request) for _ in range(64)))  # 64 at once
    assert server.most_at_once <= 4  # its two slots and at most two waiting, not 64
    assert gate.in_flight == 0 and gate.waiting == 0


async def test_a_call_that_times_out_gives_its_turn_back_and_cuts_the_limit() -> None:
    class Hangs(SlotServer):
        async def complete(self, request: LLMRequest) -> LLMResponse:
            raise Timeout("no answer", code="timeout")

    gate = ConcurrencyLimit(start=4)
    guarded = GuardedClient(Hangs(1, 0), limiter=RateLimiter(rpm=1_000_000),
                            breaker=CircuitBreaker("s", min_calls=1000), concurrency=gate)  # fmt: skip
    request = LLMRequest(messages=[{"role": "user", "content": "hi"}], model="m")
    with pytest.raises(Timeout):
        await guarded.complete(request)
    assert gate.in_flight == 0 and gate.current == 2  # 4 x 0.7


async def test_a_model_loaded_at_its_first_call_is_asked_about_once_it_answered() -> None:
    """Ollama loads a model at its first call, and says the window it gave it (`/api/ps`)
    only then: asked before, it says nothing, and the worker counted on 128,000 tokens
    where Ollama cuts prompts at 4,096. Asked again once, after the first answer."""

    class LoadsOnDemand(SlotServer):
        asked = 0

        async def describe(self, model: str) -> EndpointFacts:
            self.asked += 1
            if self.at_once == 0 and self.most_at_once == 0:  # not called yet: not loaded
                return EndpointFacts(server="ollama", unloaded=True)
            return EndpointFacts(server="ollama", context_window=4096)

    server = LoadsOnDemand(slots=1, service_s=0)
    guarded = GuardedClient(server, limiter=RateLimiter(rpm=1_000_000),
                            breaker=CircuitBreaker("o"))  # fmt: skip
    assert await guarded.context_window("qwen2.5") > 100_000  # nothing said yet
    request = LLMRequest(messages=[{"role": "user", "content": "hi"}], model="qwen2.5")
    for _ in range(3):
        await guarded.complete(request)
        await asyncio.sleep(0)
    assert (guarded.window.server_tokens, guarded.window.source) == (4096, "endpoint")
    assert server.asked == 2  # once at the start, once after the first answer
    await guarded.close()


async def test_asking_again_about_a_loaded_model_that_fails_leaves_what_was_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The second ask runs beside the calls, awaited by nobody: its failure is logged, the
    window stays as said at the start, and the calls go on."""

    class FailsTheSecondTime(SlotServer):
        asked = 0

        async def describe(self, model: str) -> EndpointFacts:
            self.asked += 1
            if self.asked > 1:
                raise RuntimeError("the endpoint's session is closed")
            return EndpointFacts(server="ollama", context_window=8192, unloaded=True)

    server = FailsTheSecondTime(slots=1, service_s=0)
    guarded = GuardedClient(server, limiter=RateLimiter(rpm=1_000_000),
                            breaker=CircuitBreaker("o"))  # fmt: skip
    await guarded.context_window("qwen2.5")
    request = LLMRequest(messages=[{"role": "user", "content": "hi"}], model="qwen2.5")
    for _ in range(3):
        await guarded.complete(request)
        await asyncio.sleep(0)
    assert server.asked == 2 and guarded.window.server_tokens == 8192
    assert any("asking again what it gave qwen2.5 failed" in r.getMessage() for r in caplog.records)
    await guarded.close()
