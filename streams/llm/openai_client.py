"""The OpenAI SDK adapter: one attempt per call, errors mapped to our taxonomy.

The SDK's own retries are off (`max_retries=0`): the retry policy is ours alone.
"""

from __future__ import annotations

from typing import Any

import httpx2  # the SDK's HTTP layer; its Response carries the headers
import openai
import orjson

from streams.errors import (
    TaskError,
    Timeout,
    UpstreamError,
)
from streams.llm.client import (
    LLMRequest,
    LLMResponse,
    error_for_status,
    parse_completion,
    request_body,
)


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


def rate_headers(headers: Any) -> dict[str, str]:
    """The `x-ratelimit-*` headers of a response."""
    return {k.lower(): v for k, v in headers.items() if k.lower().startswith("x-ratelimit-")}


def _error_code(exc: openai.APIStatusError) -> str | None:
    body = exc.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("code"):
            return str(inner["code"])
    code = getattr(exc, "code", None)
    return str(code) if code else None


def _refused(exc: BaseException) -> OSError | None:
    """The socket error under an SDK error, when one is there and is not a timeout."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, OSError) and not isinstance(seen, TimeoutError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def map_error(exc: Exception) -> TaskError:
    """Translate an SDK exception into our taxonomy, keeping the original as cause."""
    refused = _refused(exc) if isinstance(exc, openai.APITimeoutError) else None
    if refused is not None:
        # The aiohttp transport reports a refused connection as a connect *timeout*.
        return UpstreamError(f"cannot reach the LLM endpoint: {refused}", code="connection_error")
    if isinstance(exc, openai.APITimeoutError):
        return Timeout(f"LLM call timed out: {exc}", code="timeout")
    if isinstance(exc, openai.APIConnectionError):
        return UpstreamError(f"cannot reach the LLM endpoint: {exc}", code="connection_error")
    if isinstance(exc, openai.APIStatusError):
        status = exc.status_code
        return error_for_status(
            status, _error_code(exc), f"HTTP {status}: {exc.message}",
            retry_after=retry_after_seconds(exc.response.headers),
        )  # fmt: skip
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
            # aiohttp transport: the SDK's recommended one for high concurrency.
            http_client=openai.DefaultAioHttpClient(timeout=timeout),
        )

    async def complete(self, request: LLMRequest) -> LLMResponse:
        body = request_body(request)
        try:
            # The client's generic `post` with a plain body: `chat.completions.create`
            # runs the SDK's typed-dict transform over every message and the whole
            # JSON Schema (~3 ms of CPU per call), which caps a worker near 200 calls/s.
            # Timeouts, auth headers and the SDK's error classes stay the same.
            response = await self._client.post(
                "/chat/completions",
                content=orjson.dumps(body),
                options={"headers": {"Content-Type": "application/json"}},
                cast_to=httpx2.Response,
            )
        except openai.OpenAIError as exc:
            raise map_error(exc) from exc
        return parse_completion(response.content, request.model, rate_headers(response.headers))

    # -- Files and Batch API (the batch lane) ------------------------------------------

    async def upload_batch_file(self, data: bytes, name: str) -> str:
        """Upload a JSONL batch input file; its file id."""
        try:
            found = await self._client.files.create(
                file=(name, data, "application/jsonl"), purpose="batch"
            )
        except openai.OpenAIError as exc:
            raise map_error(exc) from exc
        return str(found.id)

    async def create_batch(self, input_file_id: str, metadata: dict[str, str]) -> dict[str, Any]:
        try:
            batch = await self._client.batches.create(
                input_file_id=input_file_id,
                endpoint="/v1/chat/completions",
                completion_window="24h",
                metadata=metadata,
            )
        except openai.OpenAIError as exc:
            raise map_error(exc) from exc
        return batch.model_dump()

    async def retrieve_batch(self, batch_id: str) -> dict[str, Any]:
        try:
            batch = await self._client.batches.retrieve(batch_id)
        except openai.OpenAIError as exc:
            raise map_error(exc) from exc
        return batch.model_dump()

    async def list_batches(
        self, after: str | None = None, limit: int = 100
    ) -> list[dict[str, Any]]:
        """One page of batches, newest first."""
        try:
            if after:
                page = await self._client.batches.list(limit=limit, after=after)
            else:
                page = await self._client.batches.list(limit=limit)
        except openai.OpenAIError as exc:
            raise map_error(exc) from exc
        return [b.model_dump() for b in page.data]

    async def file_content(self, file_id: str) -> bytes:
        try:
            content = await self._client.files.content(file_id)
        except openai.OpenAIError as exc:
            raise map_error(exc) from exc
        return bytes(content.content)

    @property
    def endpoint(self) -> str:
        return str(self._client.base_url)

    async def close(self) -> None:
        await self._client.close()
