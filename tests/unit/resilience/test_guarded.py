"""The guarded client against the simulator: limiter learning, breaker during an outage."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from streams.dev.simulator import SimulatorServer
from streams.errors import REDRIVABLE, AuthError, CircuitOpen, RateLimited, UpstreamError
from streams.llm.openai_client import OpenAIClient
from streams.resilience.breaker import CircuitBreaker, State
from streams.resilience.guarded import GuardedClient
from streams.resilience.limiter import RateLimiter
from tests.fakes import SIM_REQUEST, FakeLLM

REQ = SIM_REQUEST


@pytest.fixture
async def client(simulator: SimulatorServer) -> AsyncIterator[OpenAIClient]:
    c = OpenAIClient(
        base_url=simulator.base_url, api_key="k", connect_timeout_s=1, read_timeout_s=1
    )
    yield c
    await c.close()


async def test_headers_teach_the_limiter_the_real_limit(
    simulator: SimulatorServer, client: OpenAIClient
) -> None:
    simulator.sim.config.rpm = 600
    simulator.sim.config.tpm = 600_000
    guarded = GuardedClient(
        client, limiter=RateLimiter(rpm=100_000, tpm=10_000_000), breaker=CircuitBreaker("sim")
    )
    await guarded.complete(REQ)
    snap = guarded.limiter.snapshot()
    assert snap.rpm_ceiling == 600 and snap.rpm == 600
    assert snap.tpm_ceiling == 600_000


async def test_with_learned_limits_a_burst_gets_no_429(
    simulator: SimulatorServer, client: OpenAIClient
) -> None:
    simulator.sim.config.rpm = 1200  # 20/s, bursts of 20
    guarded = GuardedClient(client, limiter=RateLimiter(rpm=1200), breaker=CircuitBreaker("sim"))
    await asyncio.gather(*(guarded.complete(REQ) for _ in range(40)))
    stats = simulator.sim.snapshot()
    assert stats["by_status"] == {"200": 40}


async def test_a_429_throttles_the_limiter(
    simulator: SimulatorServer, client: OpenAIClient
) -> None:
    simulator.sim.config.rpm = 60
    guarded = GuardedClient(client, limiter=RateLimiter(rpm=100_000), breaker=CircuitBreaker("sim"))
    await guarded.complete(REQ)
    with pytest.raises(RateLimited) as info:
        await guarded.client.complete(REQ)  # straight to the endpoint: 429 with headers
    guarded.limiter.observe(info.value.headers)
    guarded.limiter.throttled(info.value.retry_after)
    snap = guarded.limiter.snapshot()
    assert snap.rpm_ceiling == 60 and snap.rpm < 60 and snap.paused_for_s > 0
    assert guarded.breaker.state is State.CLOSED  # throttling is not an outage


async def test_outage_opens_the_breaker_and_calls_stop(
    simulator: SimulatorServer, client: OpenAIClient
) -> None:
    breaker = CircuitBreaker(
        "sim", window_s=60, min_calls=5, failure_rate=0.5, open_s=0.3, probes=2
    )
    guarded = GuardedClient(client, limiter=RateLimiter(rpm=100_000), breaker=breaker)
    simulator.sim.config.error_503_rate = 1.0
    failures = []
    for _ in range(5):
        with pytest.raises(UpstreamError) as caught:
            await guarded.complete(REQ)
        failures.append(caught.value.endpoint_down)
    assert breaker.state is State.OPEN
    # Only the failure that found the circuit open afterwards marks the endpoint down.
    assert failures == [False] * 4 + [True]
    with pytest.raises(CircuitOpen):  # its deadline comes before the circuit may close
        await guarded.complete(REQ, deadline_at=guarded.clock.now() + 0.1)
    assert simulator.sim.snapshot()["requests"] == 5  # no call while open
    simulator.sim.config.error_503_rate = 0.0  # the endpoint recovers
    results = await asyncio.gather(*(guarded.complete(REQ) for _ in range(6)))
    assert len(results) == 6 and breaker.state is State.CLOSED
    # After the open period: first the probes, then the rest once they succeeded.
    assert simulator.sim.snapshot()["by_status"] == {"200": 6, "503": 5}


async def test_token_estimate_is_reconciled_with_the_real_usage(client: OpenAIClient) -> None:
    limiter = RateLimiter(rpm=100_000, tpm=600_000, headroom=0, safety=1.0)
    guarded = GuardedClient(client, limiter=limiter, breaker=CircuitBreaker("sim"))
    assert limiter.tokens is not None
    full = limiter.tokens.level
    response = await guarded.complete(REQ)
    assert guarded.estimate(REQ) > response.prompt_tokens + response.completion_tokens
    assert full - limiter.tokens.level == response.prompt_tokens + response.completion_tokens


async def test_a_refused_connection_is_an_unreachable_endpoint_not_a_timeout(
    simulator: SimulatorServer, client: OpenAIClient
) -> None:
    breaker = CircuitBreaker("sim", window_s=60, min_calls=50, failure_rate=0.5, open_s=1,
                             probes=1)  # fmt: skip
    guarded = GuardedClient(client, limiter=RateLimiter(rpm=100_000), breaker=breaker)
    await simulator.stop()  # nothing listens on the port any more
    with pytest.raises(UpstreamError) as caught:
        await guarded.complete(REQ)
    assert caught.value.code == "connection_error", caught.value.message
    assert "refused" in caught.value.message or "failed" in caught.value.message
    # Not charged to the task: the endpoint is down for everyone, though still closed.
    assert caught.value.endpoint_down and breaker.state is State.CLOSED


async def test_a_refused_key_opens_the_breaker_and_calls_stop(
    simulator: SimulatorServer, client: OpenAIClient
) -> None:
    """A key revoked or expired while the worker runs: every task was an `auth` dead
    letter, at the key's full pace, none of them redrivable. The circuit opens now: the
    tasks wait for it within their deadlines (then `circuit_open`), and no more calls
    go with the key until a probe."""
    breaker = CircuitBreaker("sim", window_s=60, min_calls=3, failure_rate=0.5, open_s=60)
    guarded = GuardedClient(client, limiter=RateLimiter(rpm=100_000), breaker=breaker)
    simulator.sim.config.api_key = "the-new-key"  # the client still sends "k"
    for _ in range(3):
        with pytest.raises(AuthError) as caught:
            await guarded.complete(REQ)
        assert caught.value.key_refused and caught.value.category.value in [
            c.value for c in REDRIVABLE
        ]  # fmt: skip
    assert breaker.state is State.OPEN
    with pytest.raises(CircuitOpen):
        await guarded.complete(REQ, deadline_at=guarded.clock.now() + 0.1)
    assert simulator.sim.snapshot()["requests"] == 3


async def test_a_403_does_not_judge_the_endpoint() -> None:
    """What a key may not do (one model, one region) says nothing of the others' calls."""
    breaker = CircuitBreaker("fake", window_s=60, min_calls=3, failure_rate=0.5, open_s=60)

    def forbidden(_r: object) -> AuthError:
        return AuthError("HTTP 403: no access to this model", key_refused=False)

    guarded = GuardedClient(FakeLLM(forbidden), limiter=RateLimiter(rpm=100_000),
                            breaker=breaker)  # fmt: skip
    for _ in range(5):
        with pytest.raises(AuthError):
            await guarded.complete(REQ)
    assert breaker.state is State.CLOSED


@pytest.mark.parametrize(("status", "refused"), [(401, True), (402, True), (403, False)])
def test_which_refusals_are_the_keys(status: int, refused: bool) -> None:
    """402: OpenRouter's "insufficient credits" — every call with the key is refused
    until it is topped up. It was a `bad_request`: never redriven."""
    from streams.llm.client import error_for_status

    error = error_for_status(status, None, f"HTTP {status}")
    assert isinstance(error, AuthError) and error.key_refused is refused


@pytest.mark.parametrize(
    ("style", "rpm", "tpm"),
    [("groq", 30, 0), ("azure", 0, 4200), ("cerebras", 30, 600_000)],
    ids=["groq-requests", "azure-tokens", "cerebras-requests"],
)
async def test_a_429s_words_teach_the_limiter_which_limit_ran_out(
    simulator: SimulatorServer, client: OpenAIClient, style: str, rpm: int, tpm: int
) -> None:
    """Groq's per-minute request limit is said in its 429s alone (its headers' is per
    day), Azure's token limit and Cerebras' request limit are named there and said
    nowhere: each was taken for another limit, or for none."""
    simulator.sim.config.update({"rpm": rpm, "tpm": tpm, "header_style": style,
                                 "latency_ms": 0, "latency_jitter_ms": 0})  # fmt: skip
    guarded = GuardedClient(client, limiter=RateLimiter(rpm=None), breaker=CircuitBreaker("sim"))
    await guarded.complete(REQ)  # a bucket of one call (or of 70 tokens): it is spent
    with pytest.raises(RateLimited):
        await guarded.complete(REQ)
    limiter = guarded.limiter
    if style == "groq":
        assert limiter.rpm_ceiling == 30  # the body's figure, not the day's 43,200
    elif style == "azure":
        assert limiter.tokens_measured and not limiter.measured
    else:
        assert limiter.measured and limiter.rpm_ceiling < 1_000_000
