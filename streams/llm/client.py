"""What the pipeline needs from an LLM endpoint, independent of any SDK."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import orjson

from streams.contract.records import InexactJSON, exact_json
from streams.errors import (
    AuthError,
    BadRequest,
    NotServed,
    RateLimited,
    TaskError,
    Timeout,
    UpstreamError,
)
from streams.llm.error_body import limit_hit
from streams.llm.overflow import overflow_of
from streams.llm.params import body_fields
from streams.llm.tokens import counter

# The answer's budget when a pipeline sets none.
DEFAULT_MAX_TOKENS = 1024


def budget_key(params: dict[str, Any]) -> str:
    """The parameter that carries the answer's token budget: `max_completion_tokens` when
    the request uses it (newer OpenAI models), else `max_tokens`."""
    return "max_completion_tokens" if "max_completion_tokens" in params else "max_tokens"


def completion_budget(params: dict[str, Any], default: int = DEFAULT_MAX_TOKENS) -> int:
    """Tokens the answer may take, whichever parameter carries them."""
    return int(params.get("max_completion_tokens") or params.get("max_tokens") or default)


def with_budget(params: dict[str, Any], tokens: int) -> dict[str, Any]:
    """The params with the answer's budget set to `tokens`, in the parameter it uses."""
    return {**params, budget_key(params): tokens}


# A model the endpoint does not serve, said with a 400 by servers other than OpenAI's 404:
# LiteLLM's proxy ("Invalid model name passed in model=X", a name its config does not
# route), DeepSeek ("Model Not Exist"); any server's `model_not_found` code.
_NOT_SERVED_SAID = re.compile(r"invalid model name passed in|\bmodel not exist\b", re.I)


def error_for_status(
    status: int,
    code: str | None,
    message: str,
    *,
    retry_after: float | None = None,
    body: Any = None,
    headers: dict[str, str] | None = None,
) -> TaskError:
    """An HTTP error answer in the project's taxonomy, one map for the synchronous calls
    and the Batch API's error lines: 429 rate_limited, 401/402/403 auth, 408 timeout, a
    prompt over the window context_overflow in any server's words (`llm.overflow`; its
    error `body` carries some servers' numbers), 409 and 5xx upstream_error, 404 a model
    (or route) not served (`NotServed`, a bad_request) — and a 400 saying so in other
    servers' words —, other 4xx bad_request. `headers`:
    the answer's rate-limit headers, for a 429's limiter to learn from as from any
    answer's. A request larger than the token limit itself (OpenAI's
    429, Groq's 413 "Request too large") is a bad_request: asked again, it never fits."""
    code = code or f"http_{status}"
    hit = limit_hit(body, message) if status in (413, 429) else None
    if hit is not None and hit.never_fits:
        return BadRequest(
            f"the request asks {hit.requested:.0f} tokens, more than the provider's limit of "
            f"{hit.limit:.0f} per minute ever admits: lower its max_tokens or its input, or "
            f"raise the limit ({message})",
            code="request_over_limit",
        )
    if status == 429:
        return RateLimited(message, retry_after=retry_after, code=code, headers=headers, hit=hit)
    if status in (401, 402, 403):  # 402: the key's credit is spent (OpenRouter)
        return AuthError(message, code=code, key_refused=status != 403)
    if status == 408:
        return Timeout(message, code=code)
    overflow = overflow_of(status, code, message, body)
    if overflow is not None:
        return overflow
    if status >= 500 or status == 409:
        return UpstreamError(message, code=code, retry_after=retry_after)
    if status == 404 or code == "model_not_found" or _NOT_SERVED_SAID.search(message):
        return NotServed(message, code=code)
    return BadRequest(message, code=code)


@dataclass(frozen=True)
class LLMRequest:
    messages: list[dict[str, str]]
    model: str
    params: dict[str, Any] = field(default_factory=dict)
    response_format: dict[str, Any] | None = None
    # A function the answer must call (its `parameters`: the output schema), for
    # endpoints that ignore `response_format`; its arguments are the answer.
    tool: dict[str, Any] | None = None
    # This attempt's read timeout, when the endpoint's pace asks for more than the
    # client's own (not sent).
    timeout_s: float | None = None


# Ends a system message that carries the output schema itself (`schema_in_prompt`: for
# endpoints that ignore `response_format`), followed by the schema as JSON.
SCHEMA_IN_PROMPT = (
    "Answer with one JSON object and nothing else. It must be valid against this JSON Schema:"
)


def request_body(request: LLMRequest) -> dict[str, Any]:
    """The chat completion body of a request (a call, or a line of a batch)."""
    body: dict[str, Any] = {**body_fields(request.params), "model": request.model,
                            "messages": request.messages}  # fmt: skip
    if request.response_format:
        body["response_format"] = request.response_format
    if request.tool is not None:
        body["tools"] = [{"type": "function", "function": request.tool}]
        body["tool_choice"] = {"type": "function", "function": {"name": request.tool["name"]}}
    return body


@dataclass(frozen=True)
class LLMResponse:
    content: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    #: the provider's `x-ratelimit-*` headers, for the limiter to learn from
    rate_headers: dict[str, str] = field(default_factory=dict)
    #: seconds from the request sent to the answer (set by the guarded client: its
    #: limiter's wait excluded)
    duration_s: float | None = None
    #: the server's own time on the request, when it says (llama.cpp's `timings`)
    server_s: float | None = None
    #: the answer came as a tool call's arguments (not as content)
    tool_called: bool = False
    #: the service tier the provider says it answered in (OpenAI echoes it; None: unsaid)
    service_tier: str | None = None
    #: prompt tokens (among `prompt_tokens`) the provider read from its prompt cache, as it
    #: says: OpenAI's `usage.prompt_tokens_details.cached_tokens` (Azure, vLLM, LiteLLM and
    #: others send the same), DeepSeek's `prompt_cache_hit_tokens`; 0 when unsaid
    cached_prompt_tokens: int = 0
    #: the deployment that answered (`llm.deployments`; set by the guarded client): its
    #: price is the one the tokens cost
    deployment: str = ""
    #: the model declined to answer, in its words (OpenAI's `message.refusal` under
    #: structured outputs, its content null); None: no refusal
    refusal: str | None = None


# What an answer's `finish_reason` says of its text, in the words servers use for it (the
# one map: single calls and packs read it alike). Compared in lower case.
# - cut at the answer's budget or the model's window: OpenAI and most servers "length";
#   Mistral "model_length" (the context was full); gateways passing on Anthropic's or
#   Gemini's own words "max_tokens".
# - the server gave up mid-answer (its text partial, the server's fault, asked again):
#   OpenRouter "error"; vLLM and SGLang "abort" (an engine pause, shutdown or scale-down
#   ends the request with HTTP 200 and what it had).
# - withheld by the provider's filter: OpenAI, Azure, Gemini's OpenAI API "content_filter".
_FINISHES = {
    "length": "truncated", "model_length": "truncated", "max_tokens": "truncated",
    "error": "failed", "abort": "failed",
    "content_filter": "filtered",
}  # fmt: skip


def finish_fault(finish_reason: str) -> str | None:
    """What is wrong with an answer as its finish reason says: "truncated", "failed",
    "filtered", or None (it ended as it should: "stop", "tool_calls", "eos_token", ...)."""
    return _FINISHES.get(finish_reason.lower())


class LLMClient(Protocol):
    """One attempt at a chat completion; raises streams.errors.TaskError subclasses."""

    async def complete(self, request: LLMRequest) -> LLMResponse: ...

    @property
    def endpoint(self) -> str:
        """A name of the endpoint for breaker and limiter keys (no secrets)."""
        ...

    async def close(self) -> None: ...


def usage_counted(
    request: LLMRequest,
    response: LLMResponse,
    count_prompt: Callable[[list[dict[str, str]]], int],
) -> LLMResponse | None:
    """The answer with its tokens counted here when it said none — no usage block, or
    zeros, as some gateways and older local servers answer (every prompt has tokens, so a
    prompt of 0 is none said) —; None when it said them."""
    if response.prompt_tokens > 0:
        return None
    completion = response.completion_tokens or counter()(response.content)
    return replace(response, prompt_tokens=count_prompt(request.messages),
                   completion_tokens=completion)  # fmt: skip


def parse_completion(
    raw: bytes, requested_model: str, headers: dict[str, str] | None = None
) -> LLMResponse:
    """A chat completion body -> LLMResponse; a body that is not one is an upstream error."""
    try:
        data = orjson.loads(raw)
        if (
            isinstance(data, dict)
            and isinstance(data.get("error"), dict)
            and not data.get("choices")
        ):
            raise _said_error(data["error"])
        choice = data["choices"][0]
        message = choice.get("message") or {}
        usage = data.get("usage") or {}
        content = _text(message.get("content"))
        # A tool call is only asked for as the answer (the forced function): its arguments
        # are the answer, whatever text a model wrote beside them ("I'll analyse this").
        called = _arguments(message.get("tool_calls"))
        if called:
            content = called
        return LLMResponse(
            content=content,
            model=str(data.get("model") or requested_model),
            prompt_tokens=_count(usage.get("prompt_tokens")),
            completion_tokens=_completion_tokens(usage),
            finish_reason=str(choice.get("finish_reason") or "stop"),
            rate_headers=headers or {},
            server_s=_server_seconds(data.get("timings")),
            tool_called=bool(called),
            service_tier=str(data["service_tier"]) if data.get("service_tier") else None,
            cached_prompt_tokens=_cached_tokens(usage),
            refusal=_refusal(message.get("refusal")),
        )
    except (
        orjson.JSONDecodeError,
        KeyError,
        IndexError,
        TypeError,
        AttributeError,
        ValueError,
    ) as exc:
        raise UpstreamError(
            f"endpoint answered with something that is not a chat completion: {exc!r}",
            code="malformed_response",
        ) from exc


def _said_error(error: dict[str, Any]) -> TaskError:
    """An error sent in a 200 answer's body: OpenRouter answers 200 once the model began,
    and an error after that comes as `{"error": {"code": 502, "message": ...}}`, its code
    the HTTP status it stands for. Mapped as that status (a 429 is a rate limit the limiter
    hears, an overflow an overflow); a code that is no such status, as a 502."""
    code = error.get("code")
    status = code if isinstance(code, int) and 400 <= code < 600 else 502
    said = None if status == code or code is None else str(code)[:100]
    message = str(error.get("message") or "")[:1000]
    return error_for_status(status, said, f"HTTP 200 saying an error {code}: {message}",
                            body={"error": error})  # fmt: skip


def _text(content: Any) -> str:
    """A message's content as text: a string; the text parts of a list of parts (as
    Mistral's reasoning models send it, a `thinking` part before the `text` one); none."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "".join(
            part["text"] for part in content
            if isinstance(part, dict) and part.get("type", "text") == "text"
            and isinstance(part.get("text"), str)
        )  # fmt: skip
    raise TypeError(f"message content is a {type(content).__name__}")


def _arguments(calls: Any) -> str:
    """The first tool call's arguments as JSON text: a string as sent (OpenAI's form), an
    object or array encoded (as some servers send them, decoded); "" when none."""
    if not isinstance(calls, list) or not calls or not isinstance(calls[0], dict):
        return ""
    function = calls[0].get("function")
    said = function.get("arguments") if isinstance(function, dict) else None
    if isinstance(said, dict | list):
        return orjson.dumps(said).decode()
    return said if isinstance(said, str) else ""


def _refusal(said: Any) -> str | None:
    """The model's refusal as the answer says it: text, or None (null, empty, or a shape
    a server other than OpenAI sends there: the answer is read as it is)."""
    return said if isinstance(said, str) and said.strip() else None


def _count(said: Any) -> int:
    """A token count as the answer says it; a count that is not a whole number of zero or
    more (a broken usage block) is as good as unsaid: 0, the answer kept."""
    if isinstance(said, bool) or not isinstance(said, int | float | str):
        return 0
    try:
        count = int(said)
    except (ValueError, OverflowError):
        return 0
    return max(0, count)


def _completion_tokens(usage: dict[str, Any]) -> int:
    """The answer's tokens as billed: `completion_tokens`, its reasoning within them
    (OpenAI and most servers) — or beside them, where the server counts them apart: xAI's
    `completion_tokens` is the visible answer alone, its `reasoning_tokens` (billed at the
    same price) in `completion_tokens_details`, and its `total_tokens` the sum of the
    three. Added only where the total says so."""
    said = _count(usage.get("completion_tokens"))
    details = usage.get("completion_tokens_details")
    reasoning = _count(details.get("reasoning_tokens")) if isinstance(details, dict) else 0
    total = _count(usage.get("total_tokens"))
    if reasoning and total == _count(usage.get("prompt_tokens")) + said + reasoning:
        return said + reasoning
    return said


def _cached_tokens(usage: dict[str, Any]) -> int:
    """Prompt tokens the provider says it read from its cache (at most the prompt's)."""
    details = usage.get("prompt_tokens_details")
    said = details.get("cached_tokens") if isinstance(details, dict) else None
    if said is None:
        said = usage.get("prompt_cache_hit_tokens")
    return min(_count(said), _count(usage.get("prompt_tokens")))


def _server_seconds(timings: Any) -> float | None:
    """llama.cpp's own time on a request (prompt and generation), in seconds."""
    if not isinstance(timings, dict):
        return None
    total = 0.0
    for key in ("prompt_ms", "predicted_ms"):
        value = timings.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
            total += float(value)
    return total / 1000.0 if total > 0 else None


# The opening fence and its language tag. Matched alone, greedily: one pattern for the
# whole answer (the tag, then a lazy body up to the closing fence) backtracked the tag
# against the body, in the square of a run of letters or blanks after the fence (67 s
# for a 100 KB answer).
_OPEN_FENCE = re.compile(r"\s*```[A-Za-z]*[ \t]*\n?")


# Where a reasoning model's thinking ends, when its server leaves it in the answer's text
# (DeepSeek-R1, Qwen3, QwQ served by vLLM without a reasoning parser, Ollama, LM Studio,
# llama.cpp with `--reasoning-format none`): `<think>…</think>` before the answer, or only
# the closing tag where the chat template opened the block in the prompt.
_THINK_END = "</think>"


def without_reasoning(content: str) -> str:
    """An answer without the reasoning written before it, if it has any (the text up to
    the first `</think>`; the same object when there is none)."""
    end = content.find(_THINK_END)
    return content if end < 0 else content[end + len(_THINK_END) :].lstrip()


# What an answer with an integer beyond 64 bits is told (`exact_json`).
_BIG_INTEGER_HINT = "answer it as a string"


def json_answer(content: str) -> Any:
    """An answer's JSON: the text as it is, or — when that is no JSON — without reasoning
    before it and a Markdown fence around it. Raises the first `orjson.JSONDecodeError`
    when neither is JSON, and when it holds an integer beyond 64 bits (`exact_json`: read
    as a double, a 20-digit id would change in the result)."""
    try:
        return exact_json(content, _BIG_INTEGER_HINT)
    except orjson.JSONDecodeError as exc:
        inner = unfenced(without_reasoning(content))
        if inner is content:
            raise
        try:
            return exact_json(inner, _BIG_INTEGER_HINT)
        except InexactJSON:
            raise  # JSON inside, but not as it was written
        except orjson.JSONDecodeError:
            raise exc from None


def unfenced(content: str) -> str:
    """An answer without the Markdown code fence around it, if it has one (small models
    and endpoints that ignore `response_format` write ```json ... ```)."""
    opened = _OPEN_FENCE.match(content)
    if opened is None:
        return content
    body = content[opened.end() :].rstrip()
    if not body.endswith("```"):
        return content
    return body[:-3].removesuffix("\n")
