"""What a pipeline version's `params` may hold: the body fields of an OpenAI Chat
Completions request that shape the answer, as the API reference lists them. A field the
API does not know (`temprature`) is refused when the pipeline is loaded, with the nearest
name, rather than sent to the provider (which ignores it, or refuses every call). Fields
of one server alone (llama.cpp's `top_k`, `min_p`, `repeat_penalty`; vLLM's `guided_*`)
go under `extra_body`, as the OpenAI SDK names them: merged into the body as they are.
What llm-streams sets itself, or does not support, is refused with where it is set
instead, or why.

Hand-kept: the SDK's `CompletionCreateParams` is a TypedDict of the same names, but it
also lists the fields this module refuses, and what it lists changes with the SDK's
version, where a pipeline's meaning must not.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Any

from streams.errors import BadRequest, StreamsError

EXTRA = "extra_body"

CHAT_PARAMS = frozenset({
    "temperature", "top_p", "max_tokens", "max_completion_tokens", "frequency_penalty",
    "presence_penalty", "seed", "stop", "logit_bias", "logprobs", "top_logprobs", "user",
    "safety_identifier", "metadata", "store", "reasoning_effort", "verbosity",
    "parallel_tool_calls", "prediction", "prompt_cache_key", "prompt_cache_retention",
    "modalities", "audio", "web_search_options",
})  # fmt: skip

# Not a pipeline's to set: llm-streams sets it from the pipeline, the task or the worker,
# or does not support it. Why, for the message.
OURS = {
    "model": "set from the version's `model` (or LLM_STREAMS_LLM__MODEL)",
    "messages": "set from the version's `system` and `template`",
    "response_format": "set from the version's `response_format`",
    "tools": "set from the version's `response_format: tool_call`",
    "tool_choice": "set from the version's `response_format: tool_call`",
    "functions": "set from the version's `response_format: tool_call`",
    "function_call": "set from the version's `response_format: tool_call`",
    "service_tier": "set from the task's `tier` (sync, flex or batch)",
    "stream": "not supported: answers are read whole",
    "stream_options": "not supported: answers are read whole",
    "n": "not supported: one answer per call",
}


# Sampling fields of llama.cpp, vLLM, Ollama's OpenAI API, TGI: known, but no Chat
# Completions field, so they go under `extra_body` (named for the hint alone).
SERVER_OWN = frozenset({
    "top_k", "min_p", "typical_p", "tfs_z", "top_a", "repeat_penalty", "repeat_last_n",
    "repetition_penalty", "mirostat", "mirostat_tau", "mirostat_eta", "penalize_nl",
    "cache_prompt", "n_probs", "grammar", "json_schema", "min_tokens", "ignore_eos",
    "skip_special_tokens", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "chat_template_kwargs", "dry_multiplier", "xtc_probability", "num_ctx", "num_predict",
})  # fmt: skip


def params_problems(params: dict[str, Any]) -> list[str]:
    """Why `params` cannot be sent as written, one line per field (none: it can)."""
    found = []
    for name in sorted(params):
        if name == EXTRA:
            extra = params[name]
            if not isinstance(extra, dict):
                found.append(f"params.{EXTRA} must be a mapping of body fields")
                continue
            found += [f"params.{EXTRA}.{field}: {OURS[field]}"
                      for field in sorted(extra) if field in OURS]  # fmt: skip
            continue
        if name in OURS:
            found.append(f"params.{name}: {OURS[name]}")
        elif name in SERVER_OWN:
            found.append(f"params.{name} is a server's own, no Chat Completions parameter: "
                         f"put it under params.{EXTRA}")  # fmt: skip
        elif name not in CHAT_PARAMS:
            near = difflib.get_close_matches(name, sorted(CHAT_PARAMS), n=1, cutoff=0.7)
            hint = f"did you mean {near[0]}? " if near else ""
            found.append(f"params.{name} is no Chat Completions parameter ({hint}a server's "
                         f"own goes under params.{EXTRA})")  # fmt: skip
    return found


def body_fields(params: dict[str, Any]) -> dict[str, Any]:
    """`params` as the request body carries them: `extra_body` merged in."""
    fields = {k: v for k, v in params.items() if k != EXTRA}
    fields.update(params.get(EXTRA) or {})
    return fields


PARAM = "param:"  # `GuardedClient.unhonoured`'s key of a parameter the model refused

# A parameter a model refuses, in each provider's words: OpenAI's (its reasoning models:
# o-series, gpt-5; Azure's alike) "Unsupported parameter: 'max_tokens' … Use
# 'max_completion_tokens' instead.", "Unsupported value: 'temperature' does not support 0
# …", "Unrecognized request argument supplied: reasoning_effort"; Groq's "property 'store'
# is unsupported"; Gemini's "Unknown name \"seed\": Cannot find field."; OCI's "Argument
# not supported: logit_bias".
_PARAM_REFUSED = re.compile(
    r"unsupported (?:parameter|value): '(\w+)'|unrecognized request argument supplied: (\w+)"
    r"|property '(\w+)' is unsupported|unknown name \"(\w+)\"|argument not supported: (\w+)",
    re.IGNORECASE,
)
_PARAM_INSTEAD = re.compile(r"use '(\w+)' instead", re.IGNORECASE)
_BUDGETS = {"max_tokens": "max_completion_tokens", "max_completion_tokens": "max_tokens"}


def refused_param(params: Mapping[str, Any], exc: StreamsError) -> tuple[str, str | None] | None:
    """A 400 refusing one of a request's own parameters (`params`): its name, and what to
    send it as instead when the refusal says (`max_tokens` -> `max_completion_tokens`),
    None to leave it out. The answer's budget is never left out: refused without a new
    name, it goes under its other one (Azure's API versions before 2024-09 know no
    `max_completion_tokens`)."""
    if not isinstance(exc, BadRequest):
        return None
    found = _PARAM_REFUSED.search(exc.message)
    name = next((g for g in found.groups() if g), None) if found is not None else None
    if name is None or name not in params:
        return None
    told = _PARAM_INSTEAD.search(exc.message)
    instead = told.group(1) if told is not None and told.group(1) in CHAT_PARAMS else None
    if instead is None and name in _BUDGETS:  # the other name of the same budget
        instead = _BUDGETS[name]
    return name, instead


def without_refused(params: dict[str, Any], unhonoured: dict[str, str]) -> dict[str, Any]:
    """`params` as the endpoint and model take them (`GuardedClient.unhonoured`'s
    `param:<name>` entries: sent under another name, or left out)."""
    for mode, instead in unhonoured.items():
        name = mode.removeprefix(PARAM)
        if name != mode and name in params:
            value = params[name]
            params = {k: v for k, v in params.items() if k != name}
            if instead:
                params.setdefault(instead, value)
    return params
