"""What the pipeline needs from an LLM endpoint, independent of any SDK."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from streams.errors import UpstreamError


@dataclass(frozen=True)
class LLMRequest:
    messages: list[dict[str, str]]
    model: str
    params: dict[str, Any] = field(default_factory=dict)
    response_format: dict[str, Any] | None = None


@dataclass(frozen=True)
class LLMResponse:
    content: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    #: the provider's `x-ratelimit-*` headers, for the limiter to learn from
    rate_headers: dict[str, str] = field(default_factory=dict)


class LLMClient(Protocol):
    """One attempt at a chat completion; raises streams.errors.TaskError subclasses."""

    async def complete(self, request: LLMRequest) -> LLMResponse: ...

    @property
    def endpoint(self) -> str:
        """A name of the endpoint for breaker and limiter keys (no secrets)."""
        ...

    async def close(self) -> None: ...


def parse_completion(
    raw: bytes, requested_model: str, headers: dict[str, str] | None = None
) -> LLMResponse:
    """A chat completion body -> LLMResponse; a body that is not one is an upstream error."""
    try:
        data = orjson.loads(raw)
        choice = data["choices"][0]
        message = choice.get("message") or {}
        usage = data.get("usage") or {}
        return LLMResponse(
            content=message.get("content") or "",
            model=str(data.get("model") or requested_model),
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            finish_reason=str(choice.get("finish_reason") or "stop"),
            rate_headers=headers or {},
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
