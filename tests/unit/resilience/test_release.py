"""Every breaker slot and limiter permit is given back on every way out of a call,
cancellation included, and one call takes one slot."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from streams.errors import DeadlineExceeded, Timeout, UpstreamError
from streams.llm.client import LLMRequest
from streams.resilience.breaker import CircuitBreaker, State
from streams.resilience.guarded import CUT_SHORT, GuardedClient
from streams.resilience.limiter import RateLimiter
from tests.fakes import FakeLLM, answer

REQ = LLMRequest(messages=[{"role": "user", "content": "hi"}], model="fake-1",
                 params={"max_tokens": 10})  # fmt: skip


def half_open(probes: int) -> CircuitBreaker:
    """A breaker that opened and whose open period is over (half-open on the next call)."""
    breaker = CircuitBreaker("fake", window_s=60, min_calls=1, failure_rate=0.5, open_s=0.01,
                             probes=probes)  # fmt: skip
    admission = breaker.admit()
    assert admission is not None
    breaker.settle(admission, False)
    assert breaker.state is State.OPEN
    return breaker


async def test_a_probe_cancelled_mid_call_gives_its_slot_back() -> None:
    hanging = FakeLLM(lambda _r: None)
    breaker = half_open(probes=1)
    guarded = GuardedClient(hanging, limiter=RateLimiter(rpm=1_000_000), breaker=breaker)
    await asyncio.sleep(0.02)
    probe = asyncio.create_task(guarded.complete(REQ))
    await hanging.called(1)
    assert breaker.state is State.HALF_OPEN and breaker.probes_out() == 1
    probe.cancel()  # the task's deadline, a shutdown, a rebalance
    with pytest.raises(asyncio.CancelledError):
        await probe
    assert breaker.probes_out() == 0
    hanging.behaviour = lambda _r: answer({"ok": True})  # the endpoint recovers
    await asyncio.wait_for(guarded.complete(REQ), 1)  # the next call probes, and closes it
    assert breaker.state is State.CLOSED


async def test_a_model_probe_cancelled_mid_call_or_before_it_gives_its_slot_back() -> None:
    """The model's own breaker (made at a 404 saying the endpoint does not serve it):
    its probe slot comes back whether the call is cancelled in flight or while it waits
    for the endpoint's breaker."""
    hanging = FakeLLM(lambda _r: None)
    endpoint = half_open(probes=1)
    guarded = GuardedClient(hanging, limiter=RateLimiter(rpm=1_000_000),
                            breaker=CircuitBreaker("fake"))  # fmt: skip
    model = guarded.model_breaker = half_open(probes=1)
    await asyncio.sleep(0.02)
    probe = asyncio.create_task(guarded.complete(REQ))
    await hanging.called(1)
    assert model.state is State.HALF_OPEN and model.probes_out() == 1
    probe.cancel()
    with pytest.raises(asyncio.CancelledError):
        await probe
    assert model.probes_out() == 0
    guarded.breaker = endpoint  # now the endpoint's probe is out too: the next call waits
    first = asyncio.create_task(guarded.complete(REQ))
    await hanging.called(2)
    assert endpoint.probes_out() == 1 and model.probes_out() == 1
    model.probes = 2
    second = asyncio.create_task(guarded.complete(REQ))  # the model's slot, then waits
    await asyncio.sleep(0.05)
    assert model.probes_out() == 2 and len(hanging.requests) == 2
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    assert model.probes_out() == 1  # given back though its call was never made
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert model.probes_out() == 0 and endpoint.probes_out() == 0


async def test_callers_waiting_for_a_probe_slot_go_once_it_is_free() -> None:
    hanging = FakeLLM(lambda _r: None)
    breaker = half_open(probes=1)
    guarded = GuardedClient(hanging, limiter=RateLimiter(rpm=1_000_000), breaker=breaker)
    await asyncio.sleep(0.02)
    probe = asyncio.create_task(guarded.complete(REQ))
    await hanging.called(1)
    waiters = [asyncio.create_task(guarded.complete(REQ)) for _ in range(5)]
    await asyncio.sleep(0.05)
    assert len(hanging.requests) == 1  # they wait for the probe's verdict, no call, no poll
    hanging.behaviour = lambda _r: answer({"ok": True})
    hanging.release()
    await asyncio.wait_for(asyncio.gather(probe, *waiters), 1)
    assert breaker.state is State.CLOSED and len(hanging.requests) == 6


async def test_with_a_fallback_ready_one_call_takes_one_probe_slot() -> None:
    llm = FakeLLM()
    breaker = half_open(probes=2)
    guarded = GuardedClient(llm, limiter=RateLimiter(rpm=1_000_000), breaker=breaker)
    await asyncio.sleep(0.02)
    await guarded.complete(REQ, wait_for_circuit=False)
    assert breaker.state is State.HALF_OPEN and breaker.probes_out() == 0  # 1 sent, 1 ok
    await guarded.complete(REQ, wait_for_circuit=False)  # the second of two probes
    assert breaker.state is State.CLOSED


async def test_a_call_hung_past_its_deadline_is_cut_as_a_timeout_the_breaker_counts() -> None:
    hanging = FakeLLM(lambda _r: None)
    breaker = CircuitBreaker("fake", window_s=60, min_calls=1, failure_rate=0.5, open_s=60)
    guarded = GuardedClient(hanging, limiter=RateLimiter(rpm=1_000_000), breaker=breaker,
                            slow_call_s=0.05)  # fmt: skip
    with pytest.raises(Timeout) as caught:
        await guarded.complete(REQ, deadline_at=guarded.clock.now() + 0.3)
    assert caught.value.code == CUT_SHORT
    assert hanging.cancelled == 1 and breaker.state is State.OPEN


async def test_a_call_cut_at_its_deadline_soon_after_it_began_says_nothing() -> None:
    hanging = FakeLLM(lambda _r: None)
    breaker = CircuitBreaker("fake", window_s=60, min_calls=1, failure_rate=0.5, open_s=60)
    guarded = GuardedClient(hanging, limiter=RateLimiter(rpm=1_000_000), breaker=breaker,
                            slow_call_s=10)  # fmt: skip
    with pytest.raises(Timeout):
        await guarded.complete(REQ, deadline_at=guarded.clock.now() + 0.1)
    assert breaker.state is State.CLOSED  # late in its task's life, not a hung endpoint


async def test_a_learning_limiters_first_call_cancelled_lets_the_next_one_probe() -> None:
    hanging = FakeLLM(lambda _r: None)
    limiter = RateLimiter(rpm=None)  # no limit known: one call goes first
    guarded = GuardedClient(hanging, limiter=limiter, breaker=CircuitBreaker("fake"))
    first = asyncio.create_task(guarded.complete(REQ))
    await hanging.called(1)
    second = asyncio.create_task(guarded.complete(REQ))
    await asyncio.sleep(0.1)
    assert len(hanging.requests) == 1  # the second waits for the first's answer
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(hanging.called(2), 1)  # its turn passed on: the second call goes
    hanging.behaviour = lambda _r: answer({"ok": True})
    hanging.release()
    await asyncio.wait_for(second, 1)
    assert not limiter.probing


async def test_a_learning_limiters_waiter_cancelled_after_its_grant_passes_the_probe_on() -> None:
    llm = FakeLLM()
    limiter = RateLimiter(rpm=None)
    permit = await limiter.acquire()  # the probe is out
    assert permit.probe
    waiter = asyncio.create_task(limiter.acquire())
    await asyncio.sleep(0.02)
    permit.abandon()  # no answer: the waiter is granted the probe...
    await asyncio.sleep(0)
    waiter.cancel()  # ...and cancelled before it could use it
    with pytest.raises(asyncio.CancelledError):
        await waiter
    third = await asyncio.wait_for(limiter.acquire(), 1)  # not wedged
    assert third.probe
    third.abandon()
    guarded = GuardedClient(llm, limiter=limiter, breaker=CircuitBreaker("fake"))
    await guarded.complete(REQ)
    assert not limiter.probing


async def test_an_upstream_error_during_a_probe_reopens_the_circuit() -> None:
    failing = FakeLLM(lambda _r: UpstreamError("HTTP 503", code="http_503"))
    breaker = half_open(probes=1)
    guarded = GuardedClient(failing, limiter=RateLimiter(rpm=1_000_000), breaker=breaker)
    await asyncio.sleep(0.02)
    with pytest.raises(UpstreamError) as caught:
        await guarded.complete(REQ)
    assert breaker.state is State.OPEN and caught.value.endpoint_down


async def test_no_time_left_before_the_deadline_makes_no_call_and_says_nothing() -> None:
    llm = FakeLLM()
    breaker = half_open(probes=1)
    guarded = GuardedClient(llm, limiter=RateLimiter(rpm=1_000_000), breaker=breaker)
    await asyncio.sleep(0.02)
    with pytest.raises(DeadlineExceeded):
        await guarded.complete(REQ, deadline_at=guarded.clock.now() + 0.01)
    assert not llm.requests and breaker.state is State.HALF_OPEN and breaker.probes_out() == 0


async def test_a_call_sent_and_never_answered_counts_its_prompt_one_not_sent_does_not() -> None:
    """Its prompt may be billed (a server goes on with a call its client left): counted
    on the error for the task's spend, and per deployment — cut, cancelled or refused."""
    hanging = FakeLLM(lambda _r: None)
    guarded = GuardedClient(hanging, limiter=RateLimiter(rpm=1_000_000),
                            breaker=CircuitBreaker("fake"))  # fmt: skip
    prompt = guarded.count_prompt(REQ.messages)

    def counted() -> float:
        value = guarded.metrics.registry.get_sample_value(
            "llm_streams_unanswered_prompt_tokens_total", {"deployment": "default"})  # fmt: skip
        return value or 0.0

    with pytest.raises(Timeout) as caught:
        await guarded.complete(REQ, deadline_at=guarded.clock.now() + 0.1)
    assert caught.value.unanswered_tokens == prompt > 0 and counted() == prompt
    call = asyncio.create_task(guarded.complete(REQ))
    await hanging.called(2)
    call.cancel()  # a shutdown, a partition given away
    with pytest.raises(asyncio.CancelledError):
        await call
    assert counted() == 2 * prompt
    refused = GuardedClient(FakeLLM(lambda _r: UpstreamError("refused", code="connection_error")),
                            limiter=RateLimiter(rpm=1_000_000), breaker=CircuitBreaker("f"),
                            metrics=guarded.metrics)  # fmt: skip
    with pytest.raises(UpstreamError) as never:
        await refused.complete(REQ)
    assert never.value.unanswered_tokens == 0 and counted() == 2 * prompt  # nothing was sent


async def test_a_model_not_served_has_one_circuit_whatever_key_calls_it() -> None:
    """Two clients of the same endpoint and model (two keys: a pipeline's primary and a
    fallback with its own) judge one circuit of that model, the one the metrics show."""
    from streams.errors import NotServed, UpstreamError
    from streams.resilience.pool import ClientPool

    def refused(_r: LLMRequest) -> Any:
        raise NotServed("HTTP 404: the model `fake-1` does not exist", code="model_not_found")

    pool = ClientPool(base_url="fake://llm", api_key=None,
                      make_http=lambda _url, _key: FakeLLM(refused),
                      make_limiter=lambda: RateLimiter(rpm=1_000_000),
                      make_breaker=lambda name: CircuitBreaker(name, min_calls=2))  # fmt: skip
    first, second = (
        pool.get("fake://llm", "key-a", "fake-1"),
        pool.get("fake://llm", "key-b", "fake-1"),
    )
    for client in (first, second):
        with pytest.raises(UpstreamError, match="does not serve fake-1"):
            await client.complete(REQ)
    assert first.model_breaker is second.model_breaker is not None
    assert first.model_breaker.state is State.OPEN  # two refusals, from either key
    assert first.breaker.state is State.CLOSED  # the endpoint answered
