"""One task's requests: the primary model with retries, then each fallback; per attempt
the repair turn, the truncation retry, the window fit, the tier (a call, a flex call,
or a line in a Batch API batch) and the output contract.

Every retry goes through `resilience.retry.call_with_retries`; every attempt of the
sync and flex tiers through the guarded client (breaker, limiter).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any

from opentelemetry.trace import SpanKind

from streams.contract.lanes import Lane, Tier
from streams.core.batch import BatchLane
from streams.core.spend import Spend
from streams.core.window import check_repair_cap, fit_window
from streams.errors import (
    BadRequest,
    CircuitOpen,
    ContextOverflow,
    InvalidOutput,
    OutputRejected,
    RateLimited,
    StreamsError,
    TaskError,
    Transient,
    UpstreamError,
)
from streams.llm.client import (
    LLMRequest,
    LLMResponse,
    completion_budget,
    usage_counted,
    with_budget,
)
from streams.llm.params import PARAM, refused_param, without_refused
from streams.observability.genai import GENAI, GenAIMetrics, endpoint_attributes
from streams.observability.metrics import Metrics
from streams.observability.tracing import child_span, mark_error
from streams.pipelines.output import parse_output
from streams.pipelines.pipeline import Pipeline
from streams.pipelines.render import PipelineVersion, RenderedPrompt
from streams.pipelines.specs import Fallback
from streams.pipelines.structured import structured_output
from streams.resilience.guarded import CAPACITY_CODES, GuardedClient
from streams.resilience.retry import Attempts, RetryPolicy, call_with_retries
from streams.resilience.router import Route, prefix_of

log = logging.getLogger(__name__)

# Servers that turn a JSON Schema into a grammar and take all of it (a strict endpoint
# refuses keywords such as maxLength; these bound the answer with them).
GRAMMAR_SERVERS = frozenset({"llama.cpp", "vllm"})


def whole_schema(
    response_format: dict[str, Any], tool: dict[str, Any] | None, schema: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The request's structured output with the whole output schema in it (not its strict
    view): for a server whose grammar takes every keyword."""
    inner = response_format.get("json_schema")
    if isinstance(inner, dict):
        response_format = {**response_format, "json_schema": {**inner, "schema": schema}}
    if tool is not None:
        tool = {**tool, "parameters": schema}
    return response_format, tool


def refuses_json_schema(request: LLMRequest, exc: StreamsError) -> bool:
    """A refusal of the json_schema response format itself (an endpoint without structured
    outputs: llama-cpp-python's server answers 500, some gateways 400) or of the schema
    (llama.cpp's server: "JSON schema error at …", vLLM: "… not supported by xgrammar"),
    not of the task."""
    if (request.response_format or {}).get("type") != "json_schema":
        return False
    if not isinstance(exc, BadRequest | UpstreamError) or exc.code == "json_schema_refused":
        return False
    said = exc.message.lower()
    return any(word in said for word in ("json_schema", "json schema", "response_format",
                                         "grammar"))  # fmt: skip


NO_FLEX = "service_tier=flex refused"  # `GuardedClient.unhonoured`: the model has no flex tier

# The least temperature of a repair turn (one that shows the model its rejected answer).
REPAIR_TEMPERATURE = 0.7
# The guarded client of a model on the primary endpoint, or on (base_url, key env).
ClientFor = Callable[[str, str | None, str | None], GuardedClient]
# The deployments of a model (`llm.deployments`); None: it has none declared.
RouteFor = Callable[[str], Route | None]


class Calls:
    """Asks the LLM for one task's answers and checks them against the output contract."""

    def __init__(
        self,
        client: GuardedClient,
        *,
        policy: RetryPolicy,
        metrics: Metrics,
        clients: ClientFor | None = None,
        routes: RouteFor | None = None,
        genai: GenAIMetrics = GENAI,
    ) -> None:
        self.client = client
        self.genai = genai
        self.policy = policy
        self.metrics = metrics
        self.clients = clients
        self.routes = routes
        self._single: Route | None = None
        self.batches: BatchLane | None = None  # the batch tier, when the worker has one

    def route_for(self, model: str) -> Route:
        """The deployments that serve `model`; none declared for it: the primary client."""
        found = self.routes(model) if self.routes is not None else None
        if found is not None:
            return found
        if self._single is None or self._single.primary is not self.client:
            self._single = Route.single(self.client)
        return self._single

    async def call(
        self,
        pipeline: Pipeline,
        version: PipelineVersion,
        prompt: RenderedPrompt,
        attempts: Attempts,
        spend: Spend,
        lane: Lane,
        deadline_at: float,
    ) -> dict[str, Any]:
        """The primary model with retries, then each fallback on the configured categories."""
        candidates = [(self.route_for(prompt.model), prompt)]
        for fb in version.spec.fallbacks:
            candidates.append((self.fallback_route(fb), replace(prompt, model=fb.model)))

        def attempt_on(
            route: Route, candidate: RenderedPrompt, wait: bool
        ) -> Callable[[Attempts], Awaitable[dict[str, Any]]]:
            async def run(a: Attempts) -> dict[str, Any]:
                return await self._attempt(pipeline, candidate, a, spend, lane, deadline_at,
                                           route, wait_for_circuit=wait,
                                           version=version.version)  # fmt: skip

            return run

        def next_open(i: int) -> int | None:
            """The next candidate after `i` with a deployment under its spend caps: a task
            is admitted under its primary model's caps only, so a fallback whose every
            deployment is at its cap is not tried (the failure before it stands)."""
            return next((j for j in range(i + 1, len(candidates))
                         if candidates[j][0].capped_for() == 0), None)  # fmt: skip

        i = 0
        while True:
            route, candidate = candidates[i]
            has_next = i + 1 < len(candidates) and next_open(i) is not None
            try:
                # With a fallback ready, an open circuit moves on at once instead of waiting.
                return await call_with_retries(
                    attempt_on(route, candidate, not has_next), self.policy, attempts
                )
            except TaskError as exc:
                if exc.category.value not in version.spec.fallback_on:
                    raise
                after = next_open(i)  # again: a cap may have been reached meanwhile
                if after is None:
                    if i + 1 < len(candidates):
                        log.warning("%s failed with %s; its fallbacks are at their spend "
                                    "caps, not tried", candidate.model,
                                    exc.category.value)  # fmt: skip
                    raise
                log.warning("%s failed with %s; falling back to %s", candidate.model,
                            exc.category.value, candidates[after][1].model)  # fmt: skip
                attempts.previous = attempts.count
                attempts.last_error = None
                i = after

    def fallback_route(self, fallback: Fallback) -> Route:
        """A fallback model's deployments, or its client (on its own endpoint, or on the
        primary one)."""
        found = self.routes(fallback.model) if self.routes and not fallback.base_url else None
        if found is not None:
            return found
        if self.clients is None:
            raise BadRequest("fallback models need a client pool", code="no_client_pool")
        return Route.single(self.clients(fallback.model, fallback.base_url,
                                         fallback.api_key_env))  # fmt: skip

    async def _attempt(
        self,
        pipeline: Pipeline,
        prompt: RenderedPrompt,
        attempts: Attempts,
        spend: Spend,
        lane: Lane,
        deadline_at: float,
        route: Route,
        *,
        wait_for_circuit: bool = True,
        version: str = "",
    ) -> dict[str, Any]:
        client = route.pick(lane, prefix_of(prompt.messages))
        request, repair = self._next_request(pipeline, prompt, attempts, spend, client)
        params = request.params
        where = endpoint_attributes(client.endpoint, client.server)
        with child_span(
            f"chat {prompt.model}",
            kind=SpanKind.CLIENT,
            attributes={
                "gen_ai.operation.name": "chat",
                **where,
                "gen_ai.request.model": prompt.model,
                "gen_ai.request.max_tokens": completion_budget(params, 0),
                "llm_streams.attempt": attempts.count,
                "llm_streams.lane": lane.name.lower(),
            },
            record_exception=False,
        ) as span:
            sent = time.monotonic()
            try:
                response, discounted = await self.send(request, spend, attempts, lane,
                                                       deadline_at, client,
                                                       wait_for_circuit)  # fmt: skip
            except CircuitOpen:
                attempts.count -= 1  # refused locally: no call was made
                mark_error(span, CircuitOpen("circuit open"))
                raise
            except StreamsError as exc:
                mark_error(span, exc)
                if isinstance(exc, Transient) and exc.unanswered_tokens:
                    # Sent, no answer: its prompt may be billed all the same.
                    spend.went_unanswered(client.deployment, exc.unanswered_tokens)
                self.genai.attempt(request_model=prompt.model, pipeline=pipeline.name,
                                   version=version, seconds=time.monotonic() - sent,
                                   error_type=exc.category.value, endpoint=where)  # fmt: skip
                if refuses_json_schema(request, exc):
                    self.degraded(client, prompt.model, "json_schema", "schema_in_prompt")
                    raise UpstreamError(
                        f"the endpoint refuses json_schema ({exc.message[:160]}); asked again "
                        "with the schema in the prompt", code="json_schema_refused",
                    ) from exc  # fmt: skip
                refused = refused_param(request.params, exc)
                # To be sent under a name the model refused too: no way round it.
                if refused is not None and PARAM + str(refused[1]) not in client.unhonoured:
                    raise self.param_refused(client, prompt.model, pipeline.name, *refused,
                                             exc) from exc  # fmt: skip
                raise
            self._observed(span, response, request, client, sent, pipeline.name, version,
                           where)  # fmt: skip
            spend.took(response, repair=repair, discounted=discounted)
            try:
                output = parse_output(response, pipeline, prompt.variables, prompt.originals)
            except (InvalidOutput, OutputRejected) as exc:  # OutputRejected: a refusal
                spend.rejected += 1
                self.count_output(response.model, ok=False)
                mark_error(span, exc)
                raise
            self.count_output(response.model, ok=True)
            return output

    def _observed(
        self,
        span: Any,
        response: LLMResponse,
        request: LLMRequest,
        client: GuardedClient,
        sent: float,
        pipeline: str,
        version: str,
        where: Mapping[str, Any],
    ) -> None:
        """What an answered call tells: its GenAI metrics and span attributes, and an
        endpoint that answered a forced tool call with plain content."""
        took = response.duration_s
        self.genai.attempt(
            request_model=request.model, pipeline=pipeline, version=version,
            seconds=time.monotonic() - sent if took is None else took,
            response_model=self.metrics.model_label(response.model),
            input_tokens=response.prompt_tokens, output_tokens=response.completion_tokens,
            endpoint=where,
        )  # fmt: skip
        span.set_attributes({
            "gen_ai.response.model": response.model,
            "gen_ai.response.finish_reasons": [response.finish_reason],
            "gen_ai.usage.input_tokens": response.prompt_tokens,
            "gen_ai.usage.output_tokens": response.completion_tokens,
        })  # fmt: skip
        if request.tool is not None and not response.tool_called:
            self.degraded(client, response.model, "tool_call", "content")

    def _next_request(
        self,
        pipeline: Pipeline,
        prompt: RenderedPrompt,
        attempts: Attempts,
        spend: Spend,
        client: GuardedClient,
    ) -> tuple[LLMRequest, bool]:
        """What this attempt asks, after what the last one met: the prompt as it is, with a
        larger budget (truncated), or with a repair turn (an invalid answer); fitted to the
        client's window. Whether it is a repair."""
        messages = list(prompt.messages)
        params = prompt.params
        last = attempts.last_error
        if last is not None:
            self.metrics.retries.labels(last.category.value).inc()
            log.info("attempt %d of %s after %s (%s): %s", attempts.count, prompt.model,
                     last.category.value, last.code, last.message[:200])  # fmt: skip
        if isinstance(last, InvalidOutput) and last.code == "truncated":
            # Cut at the budget: the same prompt with 1.5x the budget, within the window.
            budget = completion_budget(params, spend.completion_tokens or 256)
            room = client.window.server_tokens - spend.last_prompt_tokens
            params = with_budget(params, max(1, min(int(budget * 1.5), room)))
        repair = isinstance(last, InvalidOutput) and last.code != "truncated" and bool(spend.calls)
        if repair:
            # At temperature 0 the model answers its rejected answer again, word for word
            # (0 of 23 repairs helped a real server's run): a repair samples anew.
            temperature = params.get("temperature")
            if not isinstance(temperature, int | float) or temperature < REPAIR_TEMPERATURE:
                params = {**params, "temperature": REPAIR_TEMPERATURE}
        try:
            if repair and last is not None:
                # One repair: show the model its answer and what was wrong with it.
                messages += [
                    {"role": "assistant", "content": spend.calls[-1]},
                    {"role": "user", "content": f"That answer was rejected: {last.message}. "
                     "Reply with one corrected JSON object only."},
                ]  # fmt: skip
                check_repair_cap(pipeline.spec.repair_token_cap, messages, params,
                                 spend.repair_tokens, last)  # fmt: skip
            params = fit_window(messages, params, prompt.params, client.window.tokens())
        except (OutputRejected, ContextOverflow):
            attempts.count -= 1  # refused before any call
            raise
        return self._as_taken(client, pipeline, prompt, messages, params), repair

    def _as_taken(
        self,
        client: GuardedClient,
        pipeline: Pipeline,
        prompt: RenderedPrompt,
        messages: list[dict[str, str]],
        params: dict[str, Any],
    ) -> LLMRequest:
        """The request as this endpoint and model take it: the whole schema for a grammar
        server, the schema in the prompt where json_schema was refused, the parameters
        the model refused sent under another name or left out."""
        response_format, tool = prompt.response_format, prompt.tool
        if client.facts is not None and client.facts.server in GRAMMAR_SERVERS:
            response_format, tool = whole_schema(response_format, tool, pipeline.output_schema)
        if response_format.get("type") == "json_schema" and "json_schema" in client.unhonoured:
            # This endpoint and model refused it before: the schema goes in the prompt.
            response_format, _, more = structured_output("schema_in_prompt", pipeline.name,
                                                         pipeline.output_schema)  # fmt: skip
            if messages and messages[0].get("role") == "system":
                messages = [{**messages[0], "content": messages[0]["content"] + more},
                            *messages[1:]]  # fmt: skip
        if client.unhonoured:
            params = without_refused(params, client.unhonoured)
        return LLMRequest(messages=messages, model=prompt.model, params=params,
                          response_format=response_format, tool=tool)  # fmt: skip

    async def send(
        self,
        request: LLMRequest,
        spend: Spend,
        attempts: Attempts,
        lane: Lane,
        deadline_at: float,
        client: GuardedClient | None = None,
        wait_for_circuit: bool = True,
    ) -> tuple[LLMResponse, bool]:
        """One attempt's request: a call (flex tier: at the flex price, falling back to a
        plain call when flex has no capacity or the model none), or a line in a batch
        (batch tier); and whether it was answered at the batch price."""
        if (
            spend.tier is Tier.BATCH
            and self.batches is not None
            and not self.batches.takes(spend.parking)
        ):
            log.info("a batch-tier record too large to park in the batch ledger: answered "
                     "by a call, at the sync price")  # fmt: skip
            spend.tier = Tier.SYNC
            self.metrics.mitigations.labels("*", "batch_unparkable").inc()
        if spend.tier is Tier.BATCH and spend.route is not None and self.batches is not None:
            partition, custom_id = spend.route
            response = await self.batches.complete(partition, custom_id, attempts.count, request,
                                                   spend.parking)  # fmt: skip
            m = self.metrics
            counted = usage_counted(request, response, self.client.count_prompt)
            if counted is not None:  # a batch line that said no usage
                response = counted
                m.usage_unsaid.labels(self.client.deployment).inc()
            m.llm_requests.labels(request.model, "ok", "").inc()
            # Under the model asked, as a call's (`GuardedClient`): the line's own name for
            # it (a dated snapshot) would split one model's tokens by lane.
            m.used(request.model, response.prompt_tokens, response.completion_tokens,
                   response.cached_prompt_tokens)  # fmt: skip
            return response, True
        guarded = client or self.client
        if spend.tier is Tier.FLEX and NO_FLEX in guarded.unhonoured:
            spend.tier = Tier.SYNC  # the model offers none: a plain call, at once
            self.metrics.mitigations.labels("*", "flex_fallback").inc()
        if spend.tier is Tier.FLEX:
            return await self._flex(guarded, request, spend, lane, deadline_at, wait_for_circuit)
        response = await guarded.complete(
            request, lane=lane, deadline_at=deadline_at, wait_for_circuit=wait_for_circuit
        )
        return response, False

    async def _flex(
        self,
        guarded: GuardedClient,
        request: LLMRequest,
        spend: Spend,
        lane: Lane,
        deadline_at: float,
        wait_for_circuit: bool,
    ) -> tuple[LLMResponse, bool]:
        """A flex-tier call, and whether the discount is confirmed; a plain call next
        (`spend.tier` sync) when flex has no capacity, or the model offers none."""
        flex = replace(request, params={**request.params, "service_tier": "flex"})
        try:
            response = await guarded.complete(
                flex, lane=lane, deadline_at=deadline_at, wait_for_circuit=wait_for_circuit
            )
        except RateLimited as exc:
            if exc.code not in CAPACITY_CODES:
                raise
            log.info("flex tier has no capacity (%s); this task goes on at the sync price",
                     exc.code)  # fmt: skip
            spend.tier = Tier.SYNC
            self.metrics.mitigations.labels("*", "flex_fallback").inc()
            raise
        except BadRequest as exc:
            if "service_tier" not in exc.message.lower():
                raise
            raise self._no_flex(guarded, request.model, spend, exc) from exc
        if response.service_tier == "flex":  # the discount only where it is confirmed
            return response, True
        self._unconfirmed(guarded, request.model, response.service_tier)
        return response, False

    def _no_flex(
        self, client: GuardedClient, model: str, spend: Spend, exc: BadRequest
    ) -> UpstreamError:
        """The model offers no flex tier (OpenAI: 400 "Unsupported service_tier: flex"):
        this task goes on as a plain call at the sync price, uncharged, and the model's
        later flex tasks at once (learned for the endpoint and model, said once)."""
        spend.tier = Tier.SYNC
        self.metrics.mitigations.labels("*", "flex_fallback").inc()
        if client.not_honoured(NO_FLEX, "refused"):
            log.warning("%s (%s) offers no flex tier (%s): its flex tasks are called plainly, "
                        "at the sync price", client.client.endpoint, model,
                        exc.message[:200])  # fmt: skip
        again = UpstreamError(f"the model offers no flex tier ({exc.message[:160]}); asked "
                              "again as a plain call", code="flex_refused")  # fmt: skip
        again.charged = False
        return again

    def _unconfirmed(self, client: GuardedClient, model: str, tier: str | None) -> None:
        """A flex call answered without saying it was served at flex: booked at the full
        price (an endpoint that ignores `service_tier` — llama.cpp, vLLM, most gateways —
        charges, or costs, what it does for any call), counted, said once."""
        self.metrics.discount_unconfirmed.labels(model, "flex").inc()
        if client.not_honoured("service_tier=flex", tier or "no tier"):
            log.warning("%s (%s) answered a flex call without confirming the flex tier (it "
                        "said %s): such calls are priced in full", client.client.endpoint,
                        model, tier or "nothing")  # fmt: skip

    def degraded(self, client: GuardedClient, model: str, mode: str, instead: str) -> None:
        """The endpoint did not honour `mode`: counted, and said once per endpoint, model
        and mode (a forced call answered as content is read, fenced or not, but a small
        model's prose fails the contract more often: json_schema, where it is honoured,
        makes its answers valid by grammar)."""
        self.metrics.structured_degraded.labels(model, mode, instead).inc()
        if client.not_honoured(mode, instead):
            log.warning("%s (%s) does not honour %s: it answered as %s; those answers are "
                        "read as such (json_schema, if the endpoint honours it, is surer)",
                        client.client.endpoint, model, mode, instead)  # fmt: skip

    def param_refused(
        self,
        client: GuardedClient,
        model: str,
        pipeline: str,
        name: str,
        instead: str | None,
        exc: StreamsError,
    ) -> UpstreamError:
        """The model refused parameter `name`: its later requests send it as `instead`, or
        leave it out (learned for the endpoint and model, counted and said once: by the
        first refusal, not by those of requests made before it); the attempt asks again."""
        then = f"sent as {instead}" if instead else "left out"
        if client.not_honoured(PARAM + name, instead or ""):  # the first to learn it
            kind = "param_renamed" if instead else "param_dropped"
            self.metrics.mitigations.labels(pipeline, kind).inc()
            log.warning("%s (%s) refuses %s: %s from now on (%s)", client.client.endpoint,
                        model, name, then, exc.message[:200])  # fmt: skip
        again = UpstreamError(f"the endpoint refuses {name} ({exc.message[:160]}); asked "
                              f"again with it {then}", code="param_refused")  # fmt: skip
        # Not the task's attempt: refused before any work, and each such refusal takes one
        # of the request's parameters out (so they end).
        again.charged = False
        return again

    def count_output(self, model: str, *, ok: bool) -> None:
        self.metrics.outputs.labels(self.metrics.model_label(model), "pass" if ok else "fail").inc()


__all__ = ["Calls", "ClientFor", "RouteFor"]
