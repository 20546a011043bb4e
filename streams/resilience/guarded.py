"""The guarded call: circuit breaker -> rate limiter -> one LLM attempt -> learn.

One per endpoint/model in a worker, shared by all its tasks. The retry policy
sits above it (each attempt comes through here), so every attempt waits for
capacity, is counted by the breaker, and teaches the limiter.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

from streams.contract.lanes import Lane
from streams.errors import (
    CircuitOpen,
    DeadlineExceeded,
    RateLimited,
    StreamsError,
    Timeout,
    UpstreamError,
)
from streams.llm.client import LLMClient, LLMRequest, LLMResponse, completion_budget
from streams.llm.tokens import count_messages
from streams.observability.metrics import Metrics
from streams.resilience.breaker import Admission, CircuitBreaker, State
from streams.resilience.clock import Clock, MonotonicClock
from streams.resilience.limiter import RateLimiter

# An attempt still waiting for its answer this close to the task's deadline is cut
# short here (code CUT_SHORT), so the client sees a timeout rather than a cancellation.
DEADLINE_MARGIN_S = 0.05
CUT_SHORT = "cut_at_deadline"
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
        slow_call_s: float = 10.0,
    ) -> None:
        self.client = client
        self.limiter = limiter
        self.breaker = breaker
        self.clock = clock or MonotonicClock()
        self.count_prompt = count_prompt
        self.metrics = metrics or Metrics()  # none given: one nobody scrapes
        # An attempt cut at its task's deadline counts against the endpoint once it had
        # waited this long for an answer (a hung endpoint); a shorter one says nothing.
        self.slow_call_s = slow_call_s

    def estimate(self, request: LLMRequest) -> int:
        """Tokens a call may use: prompt (offline tokenizer) + its completion budget."""
        return self.count_prompt(request.messages) + completion_budget(request.params)

    async def complete(
        self,
        request: LLMRequest,
        *,
        lane: Lane = Lane.LIVE,
        deadline_at: float | None = None,
        wait_for_circuit: bool = True,
    ) -> LLMResponse:
        """One attempt. With `wait_for_circuit=False` (a fallback is ready) an open
        circuit raises CircuitOpen at once instead of waiting for it to close.

        The breaker's admission and the limiter's permit are settled on every way out,
        cancellation included: a call cancelled by shutdown, a rebalance or its task's
        deadline gives its probe slot back instead of holding it for ever."""
        admission = await self._admit(deadline_at, wait_for_circuit)
        verdict: bool | None = None  # on the endpoint; None: this call says nothing
        try:
            if deadline_at is not None and deadline_at - self.clock.now() <= DEADLINE_MARGIN_S:
                raise DeadlineExceeded(  # no call, no verdict, no capacity taken
                    "the task's deadline leaves no time for another attempt", code="task_deadline"
                )
            # Counting tokens costs CPU; only a token limit needs the estimate — or one
            # not known yet: calls queued before the first answer tells of a TPM limit
            # would otherwise go with no tokens counted, all at once, into 429s.
            limiter = self.limiter
            counted = limiter.tokens is not None or limiter.probing
            estimate = self.estimate(request) if counted else 0
            permit = await self.limiter.acquire(estimate, lane)
            started = self.clock.now()
            try:
                response = await self._call(request, deadline_at, started)
            except RateLimited as exc:
                if exc.headers:
                    self.limiter.observe(exc.headers, permit)
                if exc.code not in CAPACITY_CODES:  # a tier without capacity is no rate limit
                    self.limiter.throttled(exc.retry_after, permit)
                permit.reconcile(0)  # refused before any token was used
                self._count(request.model, lane, permit.waited_s, started, exc)
                self.metrics.limiter_throttled.labels(request.model).inc()
                raise  # throttling says nothing about the endpoint's health
            except (Timeout, UpstreamError) as exc:
                # A call cut at its task's deadline soon after it began says nothing.
                if exc.code != CUT_SHORT or self.clock.now() - started >= self.slow_call_s:
                    verdict = False
                    self.breaker.settle(admission, False)
                # Down for everyone: its circuit is open now, or it cannot be reached at all.
                exc.endpoint_down = (
                    self.breaker.state is State.OPEN or exc.code == "connection_error"
                )
                permit.reconcile(estimate)
                self._count(request.model, lane, permit.waited_s, started, exc)
                raise exc
            except StreamsError as exc:
                verdict = True  # our request was wrong; the endpoint is fine
                permit.reconcile(0)
                self._count(request.model, lane, permit.waited_s, started, exc)
                raise
            except BaseException:  # cancelled mid-call (or a bug): no answer to learn from
                permit.abandon()
                raise
            verdict = True
            if response.rate_headers:
                self.limiter.observe(response.rate_headers, permit)
            permit.reconcile(response.prompt_tokens + response.completion_tokens)
            self._count(request.model, lane, permit.waited_s, started, None, response)
            return replace(response, duration_s=self.clock.now() - started)
        finally:
            self.breaker.settle(admission, verdict)

    async def _call(
        self, request: LLMRequest, deadline_at: float | None, started: float
    ) -> LLMResponse:
        """The endpoint's answer, cut short just before the task's deadline: a call that
        hangs past it ends as a timeout this client sees (and the breaker can count),
        not as a cancellation from outside."""
        if deadline_at is None:
            return await self.client.complete(request)
        try:
            async with asyncio.timeout(max(0.0, deadline_at - started - DEADLINE_MARGIN_S)):
                return await self.client.complete(request)
        except TimeoutError:
            raise Timeout(
                f"no answer after {self.clock.now() - started:.1f}s, at the task's deadline",
                code=CUT_SHORT,
            ) from None

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
        m.limiter_wait.labels(lane.name.lower()).observe(waited_s)
        m.llm_seconds.labels(model).observe(self.clock.now() - started)
        if error is not None:
            m.llm_requests.labels(model, "error", error.category.value).inc()
            return
        m.llm_requests.labels(model, "ok", "").inc()
        if response is not None:
            m.tokens.labels(model, "prompt").inc(response.prompt_tokens)
            m.tokens.labels(model, "completion").inc(response.completion_tokens)

    async def _admit(self, deadline_at: float | None, wait: bool) -> Admission:
        """The breaker's admission for one call, waiting while the circuit is open (or
        every probe slot of a half-open round is taken) unless `wait` is False."""
        while True:
            admission = self.breaker.admit()
            if admission is not None:
                return admission
            if not wait:
                raise CircuitOpen(f"circuit for {self.breaker.name} is open", code="circuit_open")
            if self.breaker.state is State.OPEN:
                retry_at = self.breaker.retry_at()
                if deadline_at is not None and retry_at >= deadline_at:
                    raise CircuitOpen(
                        f"circuit for {self.breaker.name} is open until after the task's deadline",
                        code="circuit_open",
                    )
                await self.clock.sleep(max(0.01, retry_at - self.clock.now()))
            else:  # half-open, its probes out: wait for a verdict or a free slot
                await asyncio.shield(self.breaker.changed())

    async def close(self) -> None:
        await self.client.close()
