"""Packed requests: a task's answer from a pack it shares with others (`core.packing`
gathers the packs and holds the wire format; this sends them and hands out the answers).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

import orjson
from opentelemetry.trace import SpanKind

from streams.contract.lanes import Lane, Tier
from streams.core.calls import Calls
from streams.core.outcome import Prepared
from streams.core.packing import (
    Item,
    Key,
    PackedAnswer,
    Packer,
    packed_messages,
    packed_schema,
    shares,
    split_answers,
)
from streams.core.spend import Spend, Tokens
from streams.core.window import fit_window
from streams.errors import InvalidOutput, OutputRejected, TaskError, Transient, UpstreamError
from streams.llm.client import (
    LLMRequest,
    LLMResponse,
    budget_key,
    completion_budget,
    finish_fault,
)
from streams.llm.params import without_refused
from streams.observability.genai import endpoint_attributes
from streams.observability.tracing import child_span
from streams.pipelines.output import check_output
from streams.pipelines.registry import PipelineRegistry
from streams.pipelines.render import RenderedPrompt
from streams.pipelines.structured import structured_output
from streams.resilience.retry import Attempts, call_with_retries
from streams.resilience.router import prefix_of

log = logging.getLogger(__name__)


class Packs:
    def __init__(self, calls: Calls, registry: PipelineRegistry) -> None:
        self.calls = calls
        self.registry = registry
        self.packer = Packer(self._send)

    async def answer(
        self,
        prep: Prepared,
        prompt: RenderedPrompt,
        attempts: Attempts,
        spend: Spend,
        lane: Lane,
        deadline_at: float,
    ) -> dict[str, Any] | None:
        """The task's answer from a pack, its share of the pack's spend taken in; None
        when it is answered alone (its pipeline does not pack, it does not qualify, or
        the pack had no valid answer for it)."""
        pipeline, version = prep.pipeline, prep.version
        packing = pipeline.spec.packing
        if packing is None or len(str(prompt.variables.get(packing.slot) or "")) > (
            packing.max_chars
        ):
            return None
        # Not packed: in a batch (which already halves the price), nor a version whose
        # schema is in its system message (a packed answer has another shape), nor a turn
        # with earlier turns in its prompt (a pack item has no conversation).
        if (
            prep.context.messages
            or spend.tier is Tier.BATCH
            or version.spec.response_format == "schema_in_prompt"
        ):
            return None
        packed = await self.ask(prep, prompt, lane, deadline_at)
        paid = Tokens(packed.prompt_tokens, packed.completion_tokens, packed.cached_prompt_tokens)
        spend.used(paid, packed.model, packed.deployment)
        for tokens, model, deployment in packed.earlier:
            spend.used(tokens, model, deployment)
        for sent, deployment in packed.unanswered:
            spend.went_unanswered(deployment, sent)
        attempts.count = attempts.previous + packed.calls
        attempts.previous = attempts.count
        outcome = "packed" if packed.output is not None else "alone"
        self.calls.metrics.packed.labels(pipeline.name, outcome).inc()
        if packed.output is None:
            log.info("task %s: %s; answering it alone", prep.task.task_id, packed.reason)
        return packed.output

    async def ask(
        self, prep: Prepared, prompt: RenderedPrompt, lane: Lane, deadline_at: float
    ) -> PackedAnswer:
        """This task's answer from a pack it shares with others (or None inside: alone)."""
        pipeline, version = prep.pipeline, prep.version
        packing = pipeline.spec.packing
        assert packing is not None
        system = prompt.messages[0]["content"]
        key = (pipeline.name, version.version, prompt.model, lane.name, system)

        def check(data: Any) -> dict[str, Any]:
            return check_output(data, pipeline, prompt.variables, prompt.originals)

        item = Item(prep.task.task_id, prompt, deadline_at, check)
        return await self.packer.submit(key, item, packing.max_items, packing.linger_s)

    async def _send(self, key: Key, items: list[Item]) -> None:
        """One request for the items; each gets its own answer, or None to go alone."""
        lane = Lane[key[3]]
        seen: set[str] = set()
        unique = []
        for item in items:
            if item.task_id in seen:
                item.settle(PackedAnswer(None, reason="its task id is twice in the pack"))
            else:
                seen.add(item.task_id)
                unique.append(item)
        items = unique
        attempts = Attempts()
        unhanded = _Unhanded()
        try:
            request = self._request(key, items)
            response = await self._call(request, items, lane, attempts, unhanded)
        except TaskError as exc:
            for item, (earlier, unanswered) in zip(items, unhanded.shared(items), strict=True):
                item.settle(PackedAnswer(None, reason=f"pack failed ({exc.category.value}: "
                                         f"{exc.message})", calls=attempts.count,
                                         earlier=earlier, unanswered=unanswered))  # fmt: skip
            return
        self._hand_out(items, response, attempts, unhanded)

    def _request(self, key: Key, items: list[Item]) -> LLMRequest:
        """The pack's request: the system prompt once, each item's message in its tags,
        the answer's budget the items' together, asked for in the version's structure."""
        pipeline = self.registry.get(key[0])
        first = items[0].prompt
        messages = packed_messages(
            key[4], [(i.task_id, i.prompt.messages[-1]["content"]) for i in items]
        )
        # The version's way of asking for structure, for the packed answer's schema
        # (versions with the schema in their prompt are not packed).
        mode = ("tool_call" if first.tool is not None
                else "json_schema" if first.response_format.get("type") == "json_schema"
                else "json_object")  # fmt: skip
        response_format, tool, _ = structured_output(
            mode, pipeline.name + "_packed", packed_schema(pipeline.output_schema)
        )
        asked = {**first.params, budget_key(first.params): completion_budget(first.params)
                 * len(items)}  # fmt: skip
        params = fit_window(messages, asked, first.params, self.calls.client.window.tokens())
        return LLMRequest(messages=messages, model=first.model, params=params,
                          response_format=response_format, tool=tool)  # fmt: skip

    async def _call(
        self,
        request: LLMRequest,
        items: list[Item],
        lane: Lane,
        attempts: Attempts,
        unhanded: _Unhanded,
    ) -> LLMResponse:
        """The pack's call, retried as a task's are, by the first item's deadline."""
        deadline_at = min(i.deadline_at for i in items)
        route = self.calls.route_for(request.model)
        prefix = prefix_of(request.messages)

        async def attempt(a: Attempts) -> LLMResponse:
            client = route.pick(lane, prefix)
            asked = request
            if client.unhonoured:  # what this model refused there, as a task's call learned
                asked = replace(request, params=without_refused(request.params, client.unhonoured))
            where = endpoint_attributes(client.endpoint, client.server)
            with child_span(
                f"chat {request.model}", kind=SpanKind.CLIENT,
                attributes={"gen_ai.operation.name": "chat", **where,
                            "gen_ai.request.model": request.model,
                            "llm_streams.pack_size": len(items),
                            "llm_streams.attempt": a.count},
            ):  # fmt: skip
                try:
                    response = await client.complete(asked, lane=lane, deadline_at=deadline_at)
                except Transient as exc:
                    if exc.unanswered_tokens:  # sent, no answer: its prompt may be billed
                        unhanded.unanswered.append((exc.unanswered_tokens, client.deployment))
                    raise
            # A pack's partial answer is not handed out: cut or filtered, its items go
            # alone (only one of them may have met the filter); failed, it is asked again.
            fault, said = finish_fault(response.finish_reason), response.finish_reason[:100]
            if fault is not None:
                unhanded.refused.append(response)
            if fault == "truncated":
                raise OutputRejected(f"pack answer cut at max_tokens ({said})", code="truncated")
            if fault == "filtered":
                raise OutputRejected(f"pack answer withheld by the content filter ({said})",
                                     code="content_filter")  # fmt: skip
            if fault == "failed":
                raise UpstreamError(f"the endpoint ended the pack's answer with an error "
                                    f"({said})", code="finish_error")  # fmt: skip
            return response

        return await call_with_retries(attempt, self.calls.policy, attempts)

    def _hand_out(
        self,
        items: list[Item],
        response: LLMResponse,
        attempts: Attempts,
        unhanded: _Unhanded,
    ) -> None:
        """Each item its answer, matched by its task id and checked on its own, and its
        share of the pack's tokens (by what it sent and got back) and of the answers
        refused before it."""
        ids = [i.task_id for i in items]
        answers = split_answers(response.content, ids)
        weights = _weights(items)
        prompt_parts = shares(response.prompt_tokens, weights)
        cached_parts = shares(response.cached_prompt_tokens, weights)
        completion_parts = shares(
            response.completion_tokens,
            [len(orjson.dumps(answers[i])) if i in answers else 0 for i in ids],
        )
        for item, prompt_tokens, completion_tokens, cached, (earlier, unanswered) in zip(
            items, prompt_parts, completion_parts, cached_parts, unhanded.shared(items),
            strict=True,
        ):  # fmt: skip
            paid = PackedAnswer(None, prompt_tokens=prompt_tokens,
                                completion_tokens=completion_tokens, model=response.model,
                                calls=attempts.count, deployment=response.deployment,
                                cached_prompt_tokens=min(cached, prompt_tokens),
                                earlier=earlier, unanswered=unanswered)  # fmt: skip
            if item.task_id not in answers:
                item.settle(replace(paid, reason="missing from the pack's answer"))
                continue
            try:
                output = item.check(answers[item.task_id])
            except InvalidOutput as exc:
                self.calls.count_output(response.model, ok=False)
                item.settle(replace(paid, reason=f"invalid in the pack: {exc.message}"))
                continue
            self.calls.count_output(response.model, ok=True)
            item.settle(replace(paid, output=output))


def _weights(items: list[Item]) -> list[int]:
    """What each item sent: its share of a pack's prompt."""
    return [len(i.prompt.messages[-1]["content"]) for i in items]


@dataclass
class _Unhanded:
    """What a pack's attempts spent that no item got: answers paid for and not handed out
    (cut, filtered, ended by the server's error), and calls sent that got no answer."""

    refused: list[LLMResponse] = field(default_factory=list)
    unanswered: list[tuple[int, str]] = field(default_factory=list)  # prompt tokens, where

    def shared(
        self, items: list[Item]
    ) -> list[tuple[tuple[tuple[Tokens, str, str], ...], tuple[tuple[int, str], ...]]]:
        """Each item's share of both (by what each sent): paid, or maybe billed, all the
        same."""
        weights = _weights(items)
        paid: list[list[tuple[Tokens, str, str]]] = [[] for _ in items]
        sent: list[list[tuple[int, str]]] = [[] for _ in items]
        for response in self.refused:
            split = zip(shares(response.prompt_tokens, weights),
                        shares(response.completion_tokens, weights),
                        shares(response.cached_prompt_tokens, weights), strict=True)  # fmt: skip
            for part, (prompt, completion, cached) in zip(paid, split, strict=True):
                tokens = Tokens(prompt, completion, min(cached, prompt))
                part.append((tokens, response.model, response.deployment))
        for tokens_sent, deployment in self.unanswered:
            for mine, share in zip(sent, shares(tokens_sent, weights), strict=True):
                mine.append((share, deployment))
        return [(tuple(p), tuple(s)) for p, s in zip(paid, sent, strict=True)]


__all__ = ["Packs"]
