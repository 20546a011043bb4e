"""The OpenAI SDK adapter: one attempt per call, errors mapped to our taxonomy.

The SDK's own retries are off (`max_retries=0`): the retry policy is ours alone.
"""

from __future__ import annotations

from typing import Any

import openai

from streams.errors import (
    AuthError,
    BadRequest,
    ContextOverflow,
    RateLimited,
    TaskError,
    Timeout,
    UpstreamError,
)
from streams.llm.client import LLMRequest, LLMResponse


def retry_after_seconds(headers: Any) -> float | None:
    """Seconds the provider asks us to wait: `retry-after-ms` wins over `retry-after`."""
    if headers is None:
        return None
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            return max(0.0, float(ms) / 1000.0)
        except ValueError:
            pass
    seconds = headers.get("retry-after")
    if seconds is not None:
        try:
            return max(0.0, float(seconds))
        except ValueError:
            return None
    return None


def _error_code(exc: openai.APIStatusError) -> str | None:
    body = exc.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("code"):
            return str(inner["code"])
    code = getattr(exc, "code", None)
    return str(code) if code else None


def map_error(exc: Exception) -> TaskError:
    """Translate an SDK exception into our taxonomy, keeping the original as cause."""
    if isinstance(exc, openai.APITimeoutError):
        return Timeout(f"LLM call timed out: {exc}", code="timeout")
    if isinstance(exc, openai.APIConnectionError):
        return UpstreamError(f"cannot reach the LLM endpoint: {exc}", code="connection_error")
    if isinstance(exc, openai.APIStatusError):
        status = exc.status_code
        code = _error_code(exc) or f"http_{status}"
        message = f"HTTP {status}: {exc.message}"
        if status == 429:
            return RateLimited(
                message, retry_after=retry_after_seconds(exc.response.headers), code=code
            )
        if status in (401, 403):
            return AuthError(message, code=code)
        if status in (408,):
            return Timeout(message, code=code)
        if status >= 500 or status == 409:
            return UpstreamError(message, code=code)
        if code == "context_length_exceeded" or "maximum context length" in exc.message:
            return ContextOverflow(message, code="context_length_exceeded")
        return BadRequest(message, code=code)
    return UpstreamError(f"unexpected LLM client error: {exc!r}", code="client_error")


class OpenAIClient:
    """`LLMClient` over `openai.AsyncOpenAI`, for any OpenAI-compatible endpoint."""

    def __init__(
        self,
        *,
        base_url: str | None,
        api_key: str | None,
        connect_timeout_s: float,
        read_timeout_s: float,
        max_connections: int = 256,
    ) -> None:
        timeout = openai.Timeout(read_timeout_s, connect=connect_timeout_s)
        self._client = openai.AsyncOpenAI(
            base_url=base_url,
            api_key=api_key or "not-needed",
            max_retries=0,
            timeout=timeout,
            http_client=openai.DefaultAsyncHttpxClient(
                timeout=timeout,
                limits=_limits(max_connections),
            ),
        )

    async def complete(self, request: LLMRequest) -> LLMResponse:
        kwargs: dict[str, Any] = dict(request.params)
        if request.response_format is not None:
            kwargs["response_format"] = request.response_format
        try:
            completion = await self._client.chat.completions.create(
                model=request.model,
                messages=request.messages,  # type: ignore[arg-type]  # plain role/content dicts
                **kwargs,
            )
        except openai.OpenAIError as exc:
            raise map_error(exc) from exc
        if not completion.choices:
            raise UpstreamError("LLM answered with no choices", code="no_choices")
        choice = completion.choices[0]
        usage = completion.usage
        return LLMResponse(
            content=choice.message.content or "",
            model=completion.model or request.model,
            prompt_tokens=usage.prompt_tokens if usage else 0,
            completion_tokens=usage.completion_tokens if usage else 0,
            finish_reason=choice.finish_reason or "stop",
        )

    async def close(self) -> None:
        await self._client.close()


def _limits(max_connections: int) -> Any:
    # The SDK re-exports its HTTP library's Limits type under varying names; reach it
    # through the client class so the adapter works across SDK versions.
    import importlib

    for module_name in ("httpx", "httpx2"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        return module.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        )
    raise RuntimeError("no HTTP client library found for the OpenAI SDK")
