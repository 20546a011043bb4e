"""The context window: what fits in it, and what to do when a prompt does not.

Plain functions of a prompt, its parameters and the model's window: the answer's
budget cut to what the window leaves (`fit_window`), an input over its token
budget split into chunks (`chunk_plan`), a slot cut after the provider said the
prompt is over its window (`shorten`), and the cap on the tokens one task may
spend on repairs (`check_repair_cap`). UTF-8 bytes bound tokens from above, so
most prompts need no token count at all.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Any

from streams.core.chunking import split_text
from streams.errors import ContextOverflow, OutputRejected, StreamsError
from streams.llm.client import DEFAULT_MAX_TOKENS, budget_key, completion_budget
from streams.llm.tokens import count_messages, counter, truncate_tokens
from streams.pipelines.pipeline import Pipeline
from streams.pipelines.render import PipelineVersion, RenderedPrompt

log = logging.getLogger(__name__)

# Share of the context window a request may fill (prompt + answer budget), and the
# smallest answer budget worth a call.
WINDOW_SHARE = 0.85
MIN_COMPLETION_TOKENS = 64


def _bytes(messages: list[dict[str, str]]) -> int:
    return sum(len(m["content"].encode()) + 8 for m in messages)


def fit_window(
    messages: list[dict[str, str]],
    params: dict[str, Any],
    configured: dict[str, Any],
    context_window: int,
) -> dict[str, Any]:
    """The params with the answer's budget cut to what the context window leaves (85% of
    it, minus the prompt), or ContextOverflow when that is under the floor: the
    pipeline's own budget, at most MIN_COMPLETION_TOKENS."""
    key = budget_key(params)
    want = completion_budget(params)
    usable = int(context_window * WINDOW_SHARE)
    if _bytes(messages) + want <= usable:
        return params
    prompt_tokens = count_messages(messages)
    room = usable - prompt_tokens
    floor = min(completion_budget(configured), MIN_COMPLETION_TOKENS)
    if room < floor:
        raise ContextOverflow(
            f"prompt of {prompt_tokens} tokens leaves {room} of the model's "
            f"{context_window}-token window ({WINDOW_SHARE:.0%} usable) for the "
            f"answer, under the floor of {floor}",
            code="context_overflow",
        )
    return params if room >= want else {**params, key: room}


def budget_overflowed(
    messages: list[dict[str, str]],
    params: dict[str, Any],
    exc: ContextOverflow,
    context_window: int,
) -> bool:
    """Was a refusal over the window the answer's budget's, not the prompt's? The prompt
    is under the window (as the server counted it, when it said) and leaves the answer
    its floor in it (`fit_window`): asked with the budget the window leaves, it fits —
    vLLM and OpenAI refuse a prompt and a `max_tokens` that together pass the window."""
    if exc.window and exc.prompt_tokens and exc.prompt_tokens >= exc.window:
        return False
    try:
        fit_window(messages, params, params, context_window)
    except ContextOverflow:
        return False
    return True


def chunk_plan(pipeline: Pipeline, prompt: RenderedPrompt, context_window: int) -> list[str] | None:
    """The chunks of the pipeline's chunking slot, or None when it fits as it is."""
    spec = pipeline.spec.chunking
    if spec is None:
        return None
    text = str(prompt.variables.get(spec.slot) or "")
    usable = int(context_window * WINDOW_SHARE) - completion_budget(prompt.params)
    if spec.max_tokens is not None:
        budget = spec.max_tokens
        if len(text.encode()) <= budget:
            return None
        count = counter()
        if count(text) <= budget:
            return None
    else:
        if _bytes(prompt.messages) <= usable:
            return None
        count = counter()
        text_tokens = count(text)
        budget = usable - (count_messages(prompt.messages) - text_tokens)
        if text_tokens <= budget:
            return None
        if budget < 32:
            raise ContextOverflow(
                f"the prompt around input.{spec.slot} leaves {budget} tokens of the "
                f"{context_window}-token window for it",
                code="context_overflow",
            )
    chunks = split_text(text, budget, min(spec.overlap_tokens, budget // 4), count)
    if len(chunks) > spec.max_chunks:
        raise ContextOverflow(
            f"input.{spec.slot} needs {len(chunks)} chunks of {budget} tokens, over the "
            f"pipeline's max_chunks of {spec.max_chunks}",
            code="too_many_chunks",
        )
    return chunks


def shorten(
    version: PipelineVersion,
    task_input: dict[str, Any],
    prompt: RenderedPrompt,
    exc: ContextOverflow,
    *,
    context_window: int,
    default_model: str,
) -> RenderedPrompt:
    """The prompt with the version's truncation slot cut to fit the context window, or
    `exc`. The server's numbers from its refusal (`exc.window`, `exc.prompt_tokens`, in
    its tokens) when it said them, else ours (`context_window`, in our tokens)."""
    policy = version.spec.on_context_overflow
    if policy is None:
        raise exc
    budget = completion_budget(prompt.params)
    ours = count_messages(prompt.messages)
    if exc.window and exc.prompt_tokens:  # its excess, in our tokens
        over = (exc.prompt_tokens + budget - exc.window) * ours / exc.prompt_tokens
        window = int(exc.window * ours / exc.prompt_tokens)
    else:
        window = context_window
        over = ours + budget - window
    text = str(prompt.variables.get(policy.slot) or "")
    text_tokens = counter()(text)
    # Cut the excess plus a margin for tokenizer differences; at least a quarter when
    # the numbers say it fits (the server counts differently from us).
    excess = max(math.ceil(over), text_tokens // 4)
    keep = text_tokens - excess - (32 + window // 100)
    if keep < 1:
        raise ContextOverflow(
            f"{exc.message} (truncating input.{policy.slot} cannot make it fit)",
            code="context_overflow_unmitigated",
        ) from exc
    shortened = truncate_tokens(text, keep, keep=policy.keep)
    log.warning("prompt over the %d-token window; input.%s cut from %d to %d tokens",
                window, policy.slot, text_tokens, keep)  # fmt: skip
    rendered = version.render({**task_input, policy.slot: shortened}, default_model)
    return replace(rendered, model=prompt.model)


def check_repair_cap(
    cap: int,
    messages: list[dict[str, str]],
    params: dict[str, Any],
    repair_tokens: int,
    last: StreamsError,
) -> None:
    """Refuse a repair that could take the task past its pipeline's repair token cap."""
    estimate = count_messages(messages) + completion_budget(params)
    if repair_tokens + estimate > cap:
        raise OutputRejected(
            f"{last.message} (not repaired: a repair may take {estimate} tokens, "
            f"{repair_tokens} spent on repairs already, cap {cap})",
            code="repair_token_cap",
        )


__all__ = [
    "DEFAULT_MAX_TOKENS",
    "MIN_COMPLETION_TOKENS",
    "WINDOW_SHARE",
    "budget_overflowed",
    "check_repair_cap",
    "chunk_plan",
    "fit_window",
    "shorten",
]
