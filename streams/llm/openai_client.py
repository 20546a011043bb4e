"""The OpenAI SDK adapter: one attempt per call, errors mapped to our taxonomy.

The SDK's own retries are off (`max_retries=0`): the retry policy is ours alone.

Chat completions, the call made for every task, go out on a lean path: one aiohttp
session posting the JSON body the project built, with the SDK's headers. The SDK's
request path (options, header merging, its httpx layer over the same aiohttp) was
a quarter of a saturated worker's CPU (bench/cpu_per_task.py). An error answer is
still turned into the SDK's own exception, by the SDK, so the map to our taxonomy
stays the one `map_error`. Files and the Batch API keep the SDK's typed calls.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import aiohttp
import httpx2  # the SDK's HTTP layer; its Response carries the headers
import openai
import orjson
from aiohttp.helpers import get_env_proxy_for_url
from yarl import URL

from streams.errors import (
    BadRequest,
    TaskError,
    Timeout,
    UpstreamError,
)
from streams.llm.client import (
    LLMRequest,
    LLMResponse,
    error_for_status,
    json_answer,
    parse_completion,
    request_body,
)
from streams.llm.deployments import AzureDeployment, Deployment
from streams.llm.endpoint import EndpointFacts, facts_from
from streams.llm.error_body import error_object, retry_delay
from streams.llm.params import PARAM, refused_param, without_refused
from streams.llm.ratelimit_headers import delay, number, openai_names

log = logging.getLogger(__name__)

# What the worker reads of an answer at most (after its content-encoding is undone): a
# chat completion is kilobytes, one with logprobs of a long answer a few megabytes. A server
# or proxy that sends more (an endless body, a gzip bomb) is cut off there, not read into
# memory whole.
MAX_RESPONSE_BYTES = 32 * 1024 * 1024
# A probe's budget for a reasoning model (one that refuses `max_tokens`: o-series, gpt-5),
# which thinks within it before its one-field answer.
REASONING_BUDGET = 1024


async def read_at_most(response: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The answer's body, or None when it is over `limit` bytes (read no further: the
    connection is closed, not drained)."""
    if response.content_length is not None and "Content-Encoding" not in response.headers:
        if response.content_length <= limit:
            return await response.read()  # the common case: said, and small
        response.close()
        return None
    body = bytearray()
    while chunk := await response.content.read(min(1 << 20, limit + 1 - len(body))):
        body += chunk
        if len(body) > limit:
            response.close()
            return None
    return bytes(body)


def retry_after_seconds(headers: Any) -> float | None:
    """Seconds the provider asks us to wait: `retry-after-ms` wins over `retry-after`."""
    if headers is None:
        return None
    ms = number(headers.get("retry-after-ms"))
    if ms is not None:
        return ms / 1000.0
    return delay(headers.get("retry-after"))


def rate_headers(headers: Any) -> dict[str, str]:
    """The rate-limit headers of a response, in OpenAI's names whoever sent them."""
    return openai_names(headers)


def _error_code(exc: openai.APIStatusError) -> str | None:
    said = error_object(exc.body).get("code") or getattr(exc, "code", None)
    return str(said) if said else None


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
        status, headers = exc.status_code, exc.response.headers
        # The error's own words: the SDK finds them in an object only (a list of errors,
        # as Gemini's OpenAI endpoint sends, it says as "Error code: 400" alone).
        said = error_object(exc.body).get("message")
        message = said if isinstance(said, str) and said else exc.message
        return error_for_status(
            status, _error_code(exc), f"HTTP {status}: {message}",
            retry_after=retry_after_seconds(headers) or retry_delay(exc.body), body=exc.body,
            headers=rate_headers(headers),
        )  # fmt: skip
    return UpstreamError(f"unexpected LLM client error: {exc!r}", code="client_error")


def _probe_as_taken(body: dict[str, Any], taken: dict[str, str]) -> dict[str, Any]:
    """A probe's body with what the model refused sent as it said or left out; a budget
    that had to be renamed is a reasoning model's: `REASONING_BUDGET` at least."""
    if taken.get(PARAM + "max_tokens") == "max_completion_tokens":
        body = {**body, "max_tokens": max(REASONING_BUDGET, int(body.get("max_tokens") or 0))}
    return without_refused(body, taken)


class OpenAIClient:
    """`LLMClient` over `openai.AsyncOpenAI` (or `AsyncAzureOpenAI`), for any
    OpenAI-compatible endpoint."""

    def __init__(
        self,
        *,
        base_url: str | None,
        api_key: str | None,
        connect_timeout_s: float,
        read_timeout_s: float,
        max_connections: int = 256,
        azure: AzureDeployment | None = None,
        headers: dict[str, str] | None = None,
        key_file: Path | None = None,
    ) -> None:
        """`key_file`: where the key was read from (a mounted secret); read again when the
        endpoint refuses the key, so a rotated secret is taken up without a restart."""
        timeout = openai.Timeout(read_timeout_s, connect=connect_timeout_s)
        # aiohttp transport: the SDK's recommended one for high concurrency.
        http = openai.DefaultAioHttpClient(timeout=timeout)
        self._client: openai.AsyncOpenAI
        if azure is not None:  # `api-key` header, /openai/deployments/<name>/, api-version
            self._client = openai.AsyncAzureOpenAI(
                azure_endpoint=azure.endpoint, azure_deployment=azure.deployment,
                api_version=azure.api_version, api_key=api_key or "not-needed",
                max_retries=0, timeout=timeout, http_client=http, default_headers=headers,
            )  # fmt: skip
        else:
            self._client = openai.AsyncOpenAI(
                base_url=base_url, api_key=api_key or "not-needed", max_retries=0,
                timeout=timeout, http_client=http, default_headers=headers,
            )  # fmt: skip
        self._endpoint = str(self._client.base_url)  # fixed for the client's life
        self._url = self._endpoint.rstrip("/") + "/chat/completions"
        # Azure's api-version, as the SDK sends it with every call.
        self._query = {k: str(v) for k, v in self._client.default_query.items()}
        self._headers = self._lean_headers()
        self._key_file = key_file
        self._retired: list[aiohttp.ClientSession] = []  # sessions of keys rotated out
        self._closing: set[asyncio.Task[None]] = set()
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s
        )
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None  # opened in the loop that calls
        # HTTPS_PROXY / NO_PROXY, as the SDK honours them, read once: aiohttp's
        # trust_env would read the environment (and ~/.netrc) on every request.
        try:
            self._proxy: URL | None = get_env_proxy_for_url(URL(self._url))[0]
        except LookupError:
            self._proxy = None

    @classmethod
    def of_deployment(
        cls,
        deployment: Deployment,
        *,
        connect_timeout_s: float,
        read_timeout_s: float,
        max_connections: int = 256,
    ) -> OpenAIClient:
        """The client of a declared deployment: its endpoint, key, auth and headers."""
        spec = deployment.spec
        return cls(base_url=spec.base_url, api_key=deployment.api_key,
                   connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s,
                   max_connections=max_connections, azure=deployment.azure,
                   headers=dict(spec.headers), key_file=spec.api_key_file)  # fmt: skip

    def _lean_headers(self) -> dict[str, str]:
        """The SDK's own headers (auth, user agent, platform) for the lean path: values
        it leaves out are its `Omit` markers, not strings."""
        sdk_headers = {**self._client.default_headers, **self._client.auth_headers}
        headers = {k: v for k, v in sdk_headers.items() if isinstance(v, str)}
        headers["Content-Type"] = "application/json"
        return headers

    def _rotated(self) -> bool:
        """The endpoint refused the key: its file read again. True when it holds another
        key — taken up at once: later calls (and the SDK's) carry it, while the calls in
        flight end on the session they began on."""
        if self._key_file is None:
            return False
        try:
            key = self._key_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            return False
        if not key or key == self._client.api_key:
            return False
        self._client.api_key = key
        self._headers = self._lean_headers()
        if self._session is not None:
            self._retire(self._session)
            self._session = None
        log.warning("the key in %s changed: later calls to %s carry the new one",
                    self._key_file, self._endpoint)  # fmt: skip
        return True

    def _retire(self, session: aiohttp.ClientSession) -> None:
        """Close a rotated key's session once the calls in flight on it are done (their
        read timeout at most; a longer attempt's is cut), at the latest with the client."""
        self._retired.append(session)

        async def close_later() -> None:
            await asyncio.sleep(2 * (self._timeout.sock_read or 60.0))
            if session in self._retired:
                self._retired.remove(session)
                await session.close()

        task = asyncio.get_running_loop().create_task(close_later())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _open(self) -> aiohttp.ClientSession:
        # The headers as the session's: aiohttp copies them per request (in C) instead of
        # merging a request's own into them key by key.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self._max_connections), timeout=self._timeout,
            headers=self._headers,
        )  # fmt: skip
        return self._session

    async def complete(self, request: LLMRequest) -> LLMResponse:
        body = orjson.dumps(request_body(request))
        session = self._session if self._session is not None else self._open()
        # A longer read timeout for this attempt when the endpoint's pace asks for one.
        timeout = self._timeout
        if request.timeout_s is not None:
            timeout = aiohttp.ClientTimeout(
                total=None, sock_connect=timeout.sock_connect, sock_read=request.timeout_s
            )
        try:
            async with session.post(self._url, data=body, proxy=self._proxy, timeout=timeout,
                                    params=self._query) as response:  # fmt: skip
                content = await read_at_most(response, MAX_RESPONSE_BYTES)
                status, headers = response.status, response.headers
        except aiohttp.ConnectionTimeoutError as exc:  # not connected in time: nothing sent
            raise Timeout(f"cannot connect to the LLM endpoint in time: {exc!r}",
                          code="connect_timeout") from exc  # fmt: skip
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise Timeout(f"LLM call timed out: {exc!r}", code="timeout") from exc
        except aiohttp.ClientConnectorError as exc:  # no connection: down for everyone
            raise UpstreamError(
                f"cannot reach the LLM endpoint: {exc}", code="connection_error"
            ) from exc
        except aiohttp.ClientError as exc:
            # Connected, then dropped with this call on it (reset, closed mid-answer): the
            # server may have died of this very request (a prompt that crashes it), so the
            # attempt counts — it is no outage that spares the task's attempts.
            raise UpstreamError(
                f"the LLM endpoint dropped the call: {exc!r}", code="connection_lost"
            ) from exc
        return self._answer(status, headers, content, request.model, session)

    def _answer(
        self,
        status: int,
        headers: Any,
        content: bytes | None,
        model: str,
        session: aiohttp.ClientSession,
    ) -> LLMResponse:
        """A chat completion's answer read: the completion, or the error it says.
        `session`: the one the call went on (its key's)."""
        # Refused with a key rotated out — since the call went, by another call's refusal,
        # or found in the key's file now: asked again with the new key, not an auth error.
        if status == 401 and (session is not self._session or self._rotated()):
            raise UpstreamError("the endpoint refused a key its file no longer holds; asked "
                                "again with the new one", code="key_rotated")  # fmt: skip
        if content is None:
            if status >= 400:  # its status says enough
                raise map_error(self._status_error(status, headers, b""))
            raise UpstreamError(f"the endpoint's answer is over {MAX_RESPONSE_BYTES} bytes",
                                code="response_too_large")  # fmt: skip
        if status >= 400:
            raise map_error(self._status_error(status, headers, content))
        return parse_completion(content, model, rate_headers(headers))

    async def describe(self, model: str, timeout_s: float = 5.0) -> EndpointFacts:
        """What the endpoint says of itself and of `model` (`llm.endpoint`): its model
        list, llama.cpp's `/props`, Ollama's `/api/show` and `/api/ps`; a route it lacks
        says nothing."""
        base = self._endpoint.rstrip("/")
        root = base.removesuffix("/v1")
        server: list[str] = []
        models = await self._get_json("GET", f"{base}/models", timeout_s, server)
        props = await self._get_json("GET", f"{root}/props", timeout_s, server)
        show = running = None
        if props is None:  # llama.cpp has no /api/show; Ollama answers it
            show = await self._get_json("POST", f"{root}/api/show", timeout_s, server,
                                        {"model": model})  # fmt: skip
        if show is not None:  # Ollama: the window its loaded model was given
            running = await self._get_json("GET", f"{root}/api/ps", timeout_s, server)
        said = server[0].lower() if server else ""
        name = "llama.cpp" if "llama.cpp" in said else None
        return facts_from(model, models, props, show, server=name, running=running)

    async def models(self, timeout_s: float = 10.0, path: str = "/models") -> tuple[int, list[str]]:
        """`GET /models` (or `path` below the endpoint): its status and the model ids it
        lists. Raises OSError, aiohttp.ClientError or TimeoutError when the endpoint cannot
        be reached."""
        session = self._session if self._session is not None else self._open()
        url = self._endpoint.rstrip("/") + path
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s),
                               proxy=self._proxy) as response:  # fmt: skip
            body = await read_at_most(response, MAX_RESPONSE_BYTES)
        if response.status != 200:
            return response.status, []
        try:
            data = orjson.loads(body or b"")
        except orjson.JSONDecodeError:
            return response.status, []
        entries = data.get("data") if isinstance(data, dict) else None
        return 200, [str(e["id"]) for e in entries or [] if isinstance(e, dict) and "id" in e]

    async def structured_support(self, model: str, timeout_s: float = 60.0) -> dict[str, str]:
        """Whether the endpoint honours each way of asking for structured output, tried
        once with a one-field answer: `json_schema` (the answer valid against it), a forced
        tool call in the object form and as `"required"` (a tool call comes back). Each is
        "honoured", "answered as text", or "refused (<why>)"."""
        schema = {"type": "object", "additionalProperties": False, "required": ["ok"],
                  "properties": {"ok": {"type": "boolean"}}}  # fmt: skip
        ask = [{"role": "user", "content": 'Answer with JSON: {"ok": true}.'}]
        base = {"model": model, "messages": ask, "max_tokens": 30, "temperature": 0}
        tool = {"type": "function", "function": {"name": "answer", "parameters": schema}}
        tries = {
            "json_schema": {**base, "response_format": {"type": "json_schema", "json_schema": {
                "name": "probe", "schema": schema, "strict": True}}},
            "tool_call (object)": {**base, "tools": [tool], "tool_choice": {
                "type": "function", "function": {"name": "answer"}}},
            "tool_call (required)": {**base, "tools": [tool], "tool_choice": "required"},
        }  # fmt: skip
        found: dict[str, str] = {}
        taken: dict[str, str] = {}  # the parameters the model refused, as the worker learns
        for name, body in tries.items():
            try:
                answer = await self._taken(body, taken, timeout_s)
            except TaskError as exc:
                found[name] = f"refused ({exc.category.value}: {exc.message[:120]})"
                continue
            if name == "json_schema":
                try:
                    ok = isinstance(json_answer(answer.content).get("ok"), bool)
                except (orjson.JSONDecodeError, AttributeError):
                    ok = False
                found[name] = "honoured" if ok else "answered as text"
            else:
                found[name] = "honoured" if answer.tool_called else "answered as text"
        return found

    async def _taken(
        self, body: dict[str, Any], taken: dict[str, str], timeout_s: float
    ) -> LLMResponse:
        """`body` answered as the model takes it: a parameter it refuses (a reasoning
        model's `max_tokens`, its temperature) sent as it says or left out, as the worker
        learns it (`llm.params`; `taken`: what was learned, for the next tries). A budget
        renamed so is a reasoning model's, which thinks within it first (`_probe_as_taken`)."""
        for _ in range(len(body)):  # each refusal takes a parameter out
            try:
                return await self.complete_raw(_probe_as_taken(body, taken), timeout_s)
            except BadRequest as exc:
                refused = refused_param(_probe_as_taken(body, taken), exc)
                if refused is None or refused[0] in ("model", "messages"):
                    raise
                taken[PARAM + refused[0]] = refused[1] or ""
        return await self.complete_raw(_probe_as_taken(body, taken), timeout_s)

    async def complete_raw(self, body: dict[str, Any], timeout_s: float) -> LLMResponse:
        """One chat completion of a body given whole (probes), errors mapped as any."""
        session = self._session if self._session is not None else self._open()
        try:
            async with session.post(
                self._url, data=orjson.dumps(body), proxy=self._proxy, params=self._query,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as response:  # fmt: skip
                content = await read_at_most(response, MAX_RESPONSE_BYTES)
                status, headers = response.status, response.headers
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise UpstreamError(f"cannot reach the LLM endpoint: {exc!r}",
                                code="connection_error") from exc  # fmt: skip
        return self._answer(status, headers, content, str(body.get("model") or ""), session)

    async def _get_json(
        self, method: str, url: str, timeout_s: float, server: list[str], body: Any = None
    ) -> Any:
        """A JSON body, or None (no such route, refused, unreachable, not JSON)."""
        session = self._session if self._session is not None else self._open()
        try:
            async with session.request(
                method, url, data=orjson.dumps(body) if body is not None else None,
                timeout=aiohttp.ClientTimeout(total=timeout_s), proxy=self._proxy,
            ) as response:  # fmt: skip
                if "Server" in response.headers and not server:
                    server.append(response.headers["Server"])
                if response.status != 200:
                    return None
                return orjson.loads(await read_at_most(response, MAX_RESPONSE_BYTES) or b"")
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError):
            return None

    def _status_error(self, status: int, headers: Any, content: bytes) -> openai.APIStatusError:
        """The SDK's exception for an error answer, as its own calls would raise it."""
        # As bytes: aiohttp decodes a header as UTF-8 (bytes it cannot, surrogate-escaped),
        # and httpx takes a text value only in ASCII — a gateway's header in its users'
        # language made every refusal a UnicodeEncodeError.
        raw = [(k.encode("utf-8", "surrogateescape"), v.encode("utf-8", "surrogateescape"))
               for k, v in headers.items()]  # fmt: skip
        response = httpx2.Response(
            status, headers=raw, content=content, request=httpx2.Request("POST", self._url),
        )  # fmt: skip
        # The SDK's status-to-exception map (BadRequestError ... InternalServerError, body
        # and message parsed): private, but the one the SDK's own calls raise through.
        return self._client._make_status_error_from_response(response)  # noqa: SLF001

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
        return self._endpoint

    async def close(self) -> None:
        for task in self._closing:
            task.cancel()
        for session in [*self._retired, self._session]:
            if session is not None:
                await session.close()
        await self._client.close()
