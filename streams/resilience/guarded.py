"""The guarded call: circuit breaker -> rate limiter -> one LLM attempt -> learn.

One per endpoint/model in a worker, shared by all its tasks. The retry policy
sits above it (each attempt comes through here), so every attempt waits for
capacity, is counted by the breaker, and teaches the limiter.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from streams.contract.lanes import Lane
from streams.errors import (
    AuthError,
    CircuitOpen,
    ContextOverflow,
    DeadlineExceeded,
    NotServed,
    RateLimited,
    StreamsError,
    Timeout,
    UpstreamError,
)
from streams.llm.client import (
    LLMClient,
    LLMRequest,
    LLMResponse,
    completion_budget,
    usage_counted,
)
from streams.llm.deployments import DEFAULT
from streams.llm.endpoint import ContextWindow, EndpointFacts
from streams.llm.tokens import count_messages
from streams.observability.metrics import Metrics
from streams.resilience.breaker import Admission, CircuitBreaker, State
from streams.resilience.clock import Clock, MonotonicClock
from streams.resilience.concurrency import ConcurrencyLimit, Served
from streams.resilience.limiter import Permit, RateLimiter

log = logging.getLogger(__name__)

# An attempt still waiting for its answer this close to the task's deadline is cut
# short here (code CUT_SHORT), so the client sees a timeout rather than a cancellation.
DEADLINE_MARGIN_S = 0.05
CUT_SHORT = "cut_at_deadline"
# Calls sent that got no answer — timed out, cut at the task's deadline, dropped mid-way:
# a hosted provider may finish one its client left, and bill it (llama.cpp cancels it:
# KNOWLEDGE.md). A call refused or never connected is not among them.
UNANSWERED = frozenset({"timeout", CUT_SHORT, "connection_lost"})
# 429 codes that say a service tier (flex) has no capacity now: not a rate limit.
CAPACITY_CODES = frozenset({"resource_unavailable", "flex_capacity"})
# Answers that say the server cannot keep up (overloaded, not down).
OVERLOAD_CODES = frozenset({"http_503", "http_529", "overloaded_error", "server_overloaded"})


@dataclass
class _Call:
    """What one attempt said: of the endpoint's health (`verdict`; None: nothing), of its
    capacity (`served`; None: nothing), and whether the endpoint serves the model
    (`model_served`; None: nothing)."""

    verdict: bool | None = None
    served: Served | None = None
    model_served: bool | None = None
    model_admitted: bool = False  # by the model's breaker (made before the call began)


def _bytes(messages: list[dict[str, str]]) -> int:
    return sum(len(m["content"].encode()) for m in messages)


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
        window: ContextWindow | None = None,
        concurrency: ConcurrencyLimit | None = None,
        read_timeout_s: float | None = None,
        deployment: str = DEFAULT,
        provider_model: str | None = None,
        make_breaker: Callable[[str], CircuitBreaker] | None = None,
    ) -> None:
        """`make_breaker`: makes the model's own breaker on the endpoint (by its name) the
        first time the endpoint says it does not serve the model (`_not_served`)."""
        self.client = client
        self.deployment = deployment  # its name (`llm.deployments`), on every answer
        self.provider_model = provider_model  # the model name its provider knows
        # Calls at once to the endpoint, learned when it sends no rate limits (none given:
        # no limit; the worker's pool gives every endpoint one that learns).
        self.concurrency = concurrency or ConcurrencyLimit.open_gate(client.endpoint)
        self.read_timeout_s = read_timeout_s  # the setting: a call's read timeout at least
        # The model's context window on this endpoint, told or learned (`llm.endpoint`).
        self.window = window or ContextWindow(name=client.endpoint)
        self.facts: EndpointFacts | None = None  # what the endpoint said of itself
        # Structured-output modes this endpoint and model did not honour, and what it did.
        self.unhonoured: dict[str, str] = {}
        self._describing: asyncio.Task[EndpointFacts] | None = None
        # The model it was asked about had not been loaded (Ollama): asked about again, once,
        # at its first answer, when the window the server gave it is said.
        self._ask_again: str | None = None
        self._asked_again = False
        self.limiter = limiter
        self.breaker = breaker
        self.make_breaker = make_breaker
        # Whether the endpoint serves this client's model, judged apart from its health:
        # made at the first 404 saying it does not (None until then: nothing to judge).
        self.model_breaker: CircuitBreaker | None = None
        self.clock = clock or MonotonicClock()
        self.count_prompt = count_prompt
        self.metrics = metrics or Metrics()  # none given: one nobody scrapes
        # An attempt cut at its task's deadline counts against the endpoint once it had
        # waited this long for an answer (a hung endpoint); a shorter one says nothing.
        self.slow_call_s = slow_call_s

    async def describe(self, model: str) -> EndpointFacts:
        """What the endpoint says of itself, asked once (however many tasks ask at once);
        it tells the window. An endpoint that says nothing leaves the defaults."""
        if self._describing is None:
            self._describing = asyncio.ensure_future(self._ask_facts(model))
        return await asyncio.shield(self._describing)

    async def _ask_facts(self, model: str) -> EndpointFacts:
        describe = getattr(self.client, "describe", None)
        facts = await describe(model) if describe is not None else EndpointFacts()
        self.facts = facts
        if facts.unloaded and not self._asked_again:
            self._ask_again = model
        self.window.tell(facts.context_window)
        self.concurrency.tell_slots(facts.slots)
        return facts

    async def _ask_loaded(self, model: str) -> EndpointFacts:
        """Asked again once the model answered; what was said before stands if it fails."""
        try:
            return await self._ask_facts(model)
        except Exception as exc:  # nobody awaits it: said here
            log.warning("%s: asking again what it gave %s failed: %r", self.endpoint, model, exc)
            return self.facts or EndpointFacts()

    @property
    def endpoint(self) -> str:
        return self.client.endpoint

    @property
    def server(self) -> str | None:
        """The server the endpoint said it is (llama.cpp, vllm, ollama), once it said."""
        return self.facts.server if self.facts is not None else None

    def not_honoured(self, mode: str, instead: str) -> bool:
        """The endpoint answered `mode` otherwise (`instead`); True the first time, which
        is worth a warning (later ones only count)."""
        first = mode not in self.unhonoured
        self.unhonoured[mode] = instead
        return first

    async def context_window(self, model: str) -> int:
        """The window a prompt for `model` is fitted to, in the project's tokens."""
        if self.facts is None:
            await self.describe(model)
        return self.window.tokens()

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

        The breaker's admission, the limiter's permit and the concurrency turn are
        settled on every way out, cancellation included: a call cancelled by shutdown, a
        rebalance or its task's deadline gives its probe slot and its turn back instead
        of holding them for ever."""
        # The model's circuit first (when the endpoint ever said it does not serve it):
        # a call waiting for it holds no probe slot of the endpoint's.
        serves = self.model_breaker
        served = None
        if serves is not None:
            served = await self._admit(serves, deadline_at, wait_for_circuit)
        try:
            admission = await self._admit(self.breaker, deadline_at, wait_for_circuit)
        except BaseException:
            if serves is not None and served is not None:
                serves.settle(served, None)
            raise
        call = _Call(model_admitted=served is not None)
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
            try:  # a turn among the calls the endpoint takes at once (time not charged)
                await self.concurrency.acquire(lane)
            except BaseException:
                permit.abandon()
                raise
            try:
                return await self._attempt(request, lane, deadline_at, permit, estimate, call,
                                           admission)  # fmt: skip
            finally:
                self.concurrency.release(call.served)
        finally:
            self.breaker.settle(admission, call.verdict)
            if serves is not None and served is not None:
                serves.settle(served, call.model_served)

    async def _attempt(
        self,
        request: LLMRequest,
        lane: Lane,
        deadline_at: float | None,
        permit: Permit,
        estimate: int,
        call: _Call,
        admission: Admission,
    ) -> LLMResponse:
        """The call itself, and what its answer (or its error) teaches the limiter, the
        concurrency limit, the window and the breaker (`call`)."""
        started = self.clock.now()
        try:
            response = await self._call(self._timed(request, estimate), deadline_at, started)
        except RateLimited as exc:  # throttling says nothing about the endpoint's health
            self._throttled(request, exc, permit)
            self._count(request.model, lane, permit.waited_s, started, exc)
            raise
        except (Timeout, UpstreamError) as exc:
            # A call cut at its task's deadline soon after it began says nothing.
            if exc.code != CUT_SHORT or self.clock.now() - started >= self.slow_call_s:
                call.verdict = False
                self.breaker.settle(admission, False)  # now: the state below is the new one
            if isinstance(exc, Timeout) or exc.code in OVERLOAD_CODES:
                call.served = Served(self.clock.now() - started, overloaded=True)
            # Down for everyone: its circuit is open now, or it cannot be reached at all.
            exc.endpoint_down = (
                self.breaker.state is State.OPEN or exc.code == "connection_error"
            )  # fmt: skip
            permit.reconcile(estimate)
            self._unanswered(request, exc)
            self._count(request.model, lane, permit.waited_s, started, exc)
            raise exc
        except ContextOverflow as exc:
            call.verdict = True  # our prompt was too long; the endpoint is fine
            self.window.overflowed(exc.window, exc.prompt_tokens,
                                   self.count_prompt(request.messages))  # fmt: skip
            permit.reconcile(0)
            self._count(request.model, lane, permit.waited_s, started, exc)
            raise
        except StreamsError as exc:  # refused: the key, a deployment's model, our request
            failed = self._refused(exc, request, lane, permit, started, call, admission)
            if failed is None:
                raise
            raise failed from exc
        except BaseException:  # cancelled mid-call (or a bug): no answer to learn from
            permit.abandon()
            self._unanswered(request)
            raise
        took = self.clock.now() - started
        if self._ask_again is not None:  # loaded now: what the server gave it is said
            model, self._ask_again, self._asked_again = self._ask_again, None, True
            self._describing = asyncio.ensure_future(self._ask_loaded(model))
        response = self._with_usage(request, response)
        call.verdict = call.model_served = True
        call.served = Served(took, response.prompt_tokens, response.completion_tokens,
                             response.server_s)  # fmt: skip
        self._learn(request, response, permit, estimate)
        self._count(request.model, lane, permit.waited_s, started, None, response)
        return replace(response, duration_s=took, deployment=self.deployment)

    def _refused(
        self,
        exc: StreamsError,
        request: LLMRequest,
        lane: Lane,
        permit: Permit,
        started: float,
        call: _Call,
        admission: Admission,
    ) -> StreamsError | None:
        """What a refusal says of the endpoint (`call.verdict`), counted; the error the
        attempt ends with instead (None: the refusal itself)."""
        permit.reconcile(0)
        if isinstance(exc, AuthError):
            # A key refused (revoked, expired) is refused for every call made with it:
            # the circuit opens, and the tasks wait for it — within their deadlines, then
            # redrivable — instead of each ending as a refusal at the key's full pace. A
            # 403 may be one model's or one request's: the endpoint is not judged by it.
            call.verdict = not exc.key_refused
            if exc.key_refused:
                self.breaker.settle(admission, False)
        elif isinstance(exc, NotServed) and self.deployment == DEFAULT:
            call.verdict = True  # the endpoint answers: it is one model that it does not serve
            return self._not_served(exc, request, lane, permit, started, call)
        elif isinstance(exc, NotServed):
            # A deployment is declared to serve its model: one that says it does not is
            # failing (as LiteLLM cools such a deployment down), and the call goes on to
            # another of the model's deployments — or waits for this one's circuit.
            call.verdict = False
            self.breaker.settle(admission, False)  # now: the state below is the new one
            return self._model_refused(exc, request, lane, permit, started, self.breaker,
                                       f"deployment {self.deployment}")  # fmt: skip
        else:  # our request was wrong, or one model of an endpoint serving others
            call.verdict = True
        self._count(request.model, lane, permit.waited_s, started, exc)
        return None

    def _not_served(
        self,
        exc: NotServed,
        request: LLMRequest,
        lane: Lane,
        permit: Permit,
        started: float,
        call: _Call,
    ) -> StreamsError | None:
        """The endpoint says it does not serve the model (a model not pulled into Ollama
        yet, a name vLLM does not know): as a deployment that says so, it is judged —
        by the model's own breaker, so the endpoint's other models are not held back —
        and the task waits for it (within its deadline, then redrivable) or goes to a
        fallback, instead of ending as a bad request at the endpoint's full pace. LiteLLM
        cools a deployment down on a 404 alike. Without `make_breaker`: the refusal."""
        if self.make_breaker is None:
            self._count(request.model, lane, permit.waited_s, started, exc)
            return None
        serves = self.model_breaker
        if serves is None:  # the first refusal: the breaker made
            serves = self.model_breaker = self.make_breaker(
                f"{self.breaker.name} model {request.model}"
            )
        if call.model_admitted:
            call.model_served = False  # settled as the call ends
        else:  # begun before the breaker was made: told of it now (a closed-state call)
            serves.settle(Admission(probe=False, round=0), False)
        return self._model_refused(exc, request, lane, permit, started, serves,
                                   self.client.endpoint)  # fmt: skip

    def _model_refused(
        self,
        exc: NotServed,
        request: LLMRequest,
        lane: Lane,
        permit: Permit,
        started: float,
        judged_by: CircuitBreaker,
        who: str,
    ) -> UpstreamError:
        """The attempt's error once `judged_by` (a deployment's breaker, or a model's on
        the default endpoint) has heard the refusal: `model_not_served`, an outage's
        (attempts not counted) while that circuit is open. Counted."""
        failed = UpstreamError(f"{who} does not serve {request.model}: {exc.message}",
                               code="model_not_served")  # fmt: skip
        failed.endpoint_down = judged_by.state is State.OPEN
        self._count(request.model, lane, permit.waited_s, started, failed)
        return failed

    def _unanswered(self, request: LLMRequest, exc: Timeout | UpstreamError | None = None) -> None:
        """A call sent that got no answer — `exc`, when its code is one of `UNANSWERED`;
        None: cancelled mid-call —: its prompt's tokens counted, and said on `exc`."""
        if exc is not None and exc.code not in UNANSWERED:
            return
        tokens = self.count_prompt(request.messages)
        self.metrics.unanswered_tokens.labels(self.deployment).inc(tokens)
        if exc is not None:
            exc.unanswered_tokens = tokens

    def _with_usage(self, request: LLMRequest, response: LLMResponse) -> LLMResponse:
        """The answer with its token usage: an answer that said none (a gateway, an older
        local server; every prompt has tokens, so 0 is none) has its tokens counted here,
        so that it is priced, capped and learned from like any other."""
        counted = usage_counted(request, response, self.count_prompt)
        if counted is None:
            return response
        self.metrics.usage_unsaid.labels(self.deployment).inc()
        if self.not_honoured("usage", "no token counts"):
            log.warning("%s (%s) answers without token usage: its tokens are counted here "
                        "with the offline tokenizer (prices and caps rest on them)",
                        self.client.endpoint, request.model)  # fmt: skip
        return counted

    def _throttled(self, request: LLMRequest, exc: RateLimited, permit: Permit) -> None:
        """What a 429 teaches the limiter: the limits its headers tell, and to wait
        (unless it is a tier without capacity, no rate limit); no token was used."""
        if exc.headers:
            self.limiter.observe(exc.headers, permit, refused=True)
            self.concurrency.open()
        if exc.code not in CAPACITY_CODES:
            self.limiter.throttled(exc.retry_after, permit, exc.hit)
        permit.reconcile(0)
        self.metrics.limiter_throttled.labels(request.model).inc()

    def _learn(
        self, request: LLMRequest, response: LLMResponse, permit: Permit, estimate: int
    ) -> None:
        """What an answer teaches: the provider's limits (and that it has some), and how
        its server counts tokens against ours."""
        if response.rate_headers:
            self.limiter.observe(response.rate_headers, permit)
            self.concurrency.open()
        if response.prompt_tokens and self.window.wants_sample():
            ours = estimate - completion_budget(request.params) if estimate else 0
            self.window.count(response.prompt_tokens,
                              ours or self.count_prompt(request.messages))  # fmt: skip
        permit.reconcile(response.prompt_tokens + response.completion_tokens)

    def _timed(self, request: LLMRequest, estimate: int) -> LLMRequest:
        """The request with its read timeout, when the endpoint's pace asks for a longer
        one than the setting (a long prompt on a slow self-hosted server)."""
        if self.read_timeout_s is None or self.concurrency.unlimited:
            return request
        budget = completion_budget(request.params)
        prompt = estimate - budget if estimate else _bytes(request.messages) // 3
        timeout = self.concurrency.timeout_for(self.read_timeout_s, prompt, budget)
        return request if timeout <= self.read_timeout_s else replace(request, timeout_s=timeout)

    async def _call(
        self, request: LLMRequest, deadline_at: float | None, started: float
    ) -> LLMResponse:
        """The endpoint's answer, cut short just before the task's deadline: a call that
        hangs past it ends as a timeout this client sees (and the breaker can count),
        not as a cancellation from outside."""
        if self.provider_model is not None and request.model != self.provider_model:
            request = replace(request, model=self.provider_model)
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
            outcome = "throttled" if isinstance(error, RateLimited) else "error"
            m.deployment_calls.labels(self.deployment, outcome).inc()
            return
        m.llm_requests.labels(model, "ok", "").inc()
        m.deployment_calls.labels(self.deployment, "ok").inc()
        if response is not None:
            m.used(model, response.prompt_tokens, response.completion_tokens,
                   response.cached_prompt_tokens)  # fmt: skip

    async def _admit(
        self, breaker: CircuitBreaker, deadline_at: float | None, wait: bool
    ) -> Admission:
        """`breaker`'s admission for one call, waiting while the circuit is open (or
        every probe slot of a half-open round is taken) unless `wait` is False."""
        while True:
            admission = breaker.admit()
            if admission is not None:
                return admission
            if not wait:
                raise CircuitOpen(f"circuit for {breaker.name} is open", code="circuit_open")
            if breaker.state is State.OPEN:
                retry_at = breaker.retry_at()
                if deadline_at is not None and retry_at >= deadline_at:
                    raise CircuitOpen(
                        f"circuit for {breaker.name} is open until after the task's deadline",
                        code="circuit_open",
                    )
                await self.clock.sleep(max(0.01, retry_at - self.clock.now()))
            else:  # half-open, its probes out: wait for a verdict or a free slot
                await asyncio.shield(breaker.changed())

    async def close(self) -> None:
        if self._describing is not None:
            self._describing.cancel()
        await self.client.close()
