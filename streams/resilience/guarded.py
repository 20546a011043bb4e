"""The guarded call: circuit breaker -> rate limiter -> one LLM attempt -> learn.

One per endpoint/model in a worker, shared by all its tasks. The retry policy
sits above it (each attempt comes through here), so every attempt waits for
capacity, is counted by the breaker, and teaches the limiter.
"""

from __future__ import annotations

from collections.abc import Callable

from streams.errors import (
    CircuitOpen,
    RateLimited,
    StreamsError,
    Timeout,
    UpstreamError,
)
from streams.llm.client import LLMClient, LLMRequest, LLMResponse
from streams.llm.tokens import count_messages
from streams.metrics import Metrics
from streams.resilience.breaker import CircuitBreaker, State
from streams.resilience.clock import Clock, MonotonicClock
from streams.resilience.limiter import Lane, RateLimiter

DEFAULT_MAX_TOKENS = 1024
# 429 codes that say a service tier (flex) has no capacity now: not a rate limit.
CAPACITY_CODES = frozenset({"resource_unavailable", "flex_capacity"})


class GuardedClient:
    def __init__(
        self,
        client: LLMClient,
        *,
        limiter: RateLimiter,
        breaker: CircuitBreaker,
        clock: Clock | None = None,
        count_prompt: Callable[[list[dict[str, str]]], int] = count_messages,
        metrics: Metrics | None = None,
    ) -> None:
        self.client = client
        self.limiter = limiter
        self.breaker = breaker
        self.clock = clock or MonotonicClock()
        self.count_prompt = count_prompt
        self.metrics = metrics

    def estimate(self, request: LLMRequest) -> int:
        """Tokens a call may use: prompt (offline tokenizer) + its completion budget."""
        budget = request.params.get("max_completion_tokens") or request.params.get("max_tokens")
        return self.count_prompt(request.messages) + int(budget or DEFAULT_MAX_TOKENS)

    async def complete(
        self,
        request: LLMRequest,
        *,
        lane: Lane = Lane.LIVE,
        deadline_at: float | None = None,
        wait_for_circuit: bool = True,
    ) -> LLMResponse:
        """One attempt. With `wait_for_circuit=False` (a fallback is ready) an open
        circuit raises CircuitOpen at once instead of waiting for it to close."""
        if not wait_for_circuit and not self.breaker.allow():
            raise CircuitOpen(f"circuit for {self.breaker.name} is open", code="circuit_open")
        await self._wait_for_circuit(deadline_at)
        # Counting tokens costs CPU; only a token limit needs the estimate.
        estimate = self.estimate(request) if self.limiter.tokens is not None else 0
        permit = await self.limiter.acquire(estimate, lane)
        started = self.clock.now()
        try:
            response = await self.client.complete(request)
        except RateLimited as exc:
            if exc.headers:
                self.limiter.observe(exc.headers)
            if exc.code not in CAPACITY_CODES:  # a tier without capacity is no rate limit
                self.limiter.throttled(exc.retry_after)
            self.breaker.release()  # throttling says nothing about the endpoint's health
            permit.reconcile(0)  # refused before any token was used
            self._count(request.model, lane, permit.waited_s, started, exc)
            if self.metrics is not None:
                self.metrics.limiter_throttled.labels(request.model).inc()
            raise
        except (Timeout, UpstreamError) as exc:
            self.breaker.record(ok=False)
            # Down for everyone: its circuit is open now, or it cannot be reached at all.
            exc.endpoint_down = self.breaker.state is State.OPEN or exc.code == "connection_error"
            permit.reconcile(estimate)
            self._count(request.model, lane, permit.waited_s, started, exc)
            raise exc
        except StreamsError as exc:
            self.breaker.record(ok=True)  # our request was wrong; the endpoint is fine
            permit.reconcile(0)
            self._count(request.model, lane, permit.waited_s, started, exc)
            raise
        self.breaker.record(ok=True)
        if response.rate_headers:
            self.limiter.observe(response.rate_headers)
        permit.reconcile(response.prompt_tokens + response.completion_tokens)
        self._count(request.model, lane, permit.waited_s, started, None, response)
        return response

    def _count(
        self,
        model: str,
        lane: Lane,
        waited_s: float,
        started: float,
        error: StreamsError | None,
        response: LLMResponse | None = None,
    ) -> None:
        m = self.metrics
        if m is None:
            return
        m.limiter_wait.labels(lane.name.lower()).observe(waited_s)
        m.llm_seconds.labels(model).observe(self.clock.now() - started)
        if error is not None:
            m.llm_requests.labels(model, "error", error.category.value).inc()
            return
        m.llm_requests.labels(model, "ok", "").inc()
        if response is not None:
            m.tokens.labels(model, "prompt").inc(response.prompt_tokens)
            m.tokens.labels(model, "completion").inc(response.completion_tokens)

    async def _wait_for_circuit(self, deadline_at: float | None) -> None:
        while not self.breaker.allow():
            retry_at = self.breaker.retry_at()
            if deadline_at is not None and retry_at >= deadline_at:
                raise CircuitOpen(
                    f"circuit for {self.breaker.name} is open until after the task's deadline",
                    code="circuit_open",
                )
            await self.clock.sleep(max(0.01, retry_at - self.clock.now()))

    async def close(self) -> None:
        await self.client.close()
