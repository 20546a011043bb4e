"""What the pipeline needs from an LLM endpoint, independent of any SDK."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


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
