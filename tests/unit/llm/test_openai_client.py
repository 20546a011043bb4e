"""The chat-completion path against the simulator: every answer and failure mapped to
the project's categories exactly as the SDK's own calls would be."""

from __future__ import annotations

import asyncio
import gzip
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
import pytest

from streams.dev.simulator import SimulatorServer
from streams.errors import (
    AuthError,
    ContextOverflow,
    RateLimited,
    TaskError,
    Timeout,
    UpstreamError,
)
from streams.llm import openai_client
from streams.llm.openai_client import OpenAIClient
from tests.fakes import SIM_REQUEST

REQ = SIM_REQUEST


async def refused(base_url: str, api_key: str) -> TaskError:
    """The error one call through a fresh client ends with."""
    c = OpenAIClient(base_url=base_url, api_key=api_key, connect_timeout_s=1, read_timeout_s=1)
    try:
        with pytest.raises(TaskError) as raised:
            await c.complete(REQ)
    finally:
        await c.close()
    return raised.value


@pytest.fixture
async def client(simulator: SimulatorServer) -> AsyncIterator[OpenAIClient]:
    simulator.sim.config.api_key = "right-key"
    c = OpenAIClient(base_url=simulator.base_url, api_key="right-key", connect_timeout_s=1,
                     read_timeout_s=0.5)  # fmt: skip
    yield c
    await c.close()


async def test_an_answer_carries_its_usage_and_rate_headers(
    simulator: SimulatorServer, client: OpenAIClient
) -> None:
    simulator.sim.config.rpm = 600
    answer = await client.complete(REQ)
    assert answer.content and answer.prompt_tokens > 0 and answer.finish_reason == "stop"
    assert answer.rate_headers["x-ratelimit-limit-requests"] == "600"


async def test_the_key_goes_with_every_call(simulator: SimulatorServer) -> None:
    simulator.sim.config.api_key = "right-key"
    error = await refused(simulator.base_url, "wrong")
    assert isinstance(error, AuthError) and error.code == "invalid_api_key"


async def test_a_429_says_how_long_to_wait(
    simulator: SimulatorServer, client: OpenAIClient
) -> None:
    simulator.sim.config.rpm = 1
    await client.complete(REQ)
    with pytest.raises(RateLimited) as raised:
        await client.complete(REQ)
    assert raised.value.retry_after is not None and raised.value.retry_after > 0
    assert "Rate limit reached" in str(raised.value)
    # Its rate-limit headers, for the limiter to learn from as from any answer's: they
    # were dropped, and a limit first met as a 429 was learned only from the answers.
    assert raised.value.headers["x-ratelimit-limit-requests"] == "1"
    assert raised.value.headers["x-ratelimit-remaining-requests"] == "0"


async def test_a_prompt_past_the_context_window_is_a_context_overflow(
    simulator: SimulatorServer, client: OpenAIClient
) -> None:
    simulator.sim.config.context_window = 20
    with pytest.raises(ContextOverflow) as raised:
        await client.complete(REQ)
    assert raised.value.code == "context_length_exceeded"


async def test_5xx_is_an_upstream_error(simulator: SimulatorServer, client: OpenAIClient) -> None:
    simulator.sim.config.error_503_rate = 1.0
    with pytest.raises(UpstreamError) as raised:
        await client.complete(REQ)
    assert "HTTP 503" in str(raised.value) and raised.value.retry_after is None
    simulator.sim.config.error_503_retry_after_s = 20
    with pytest.raises(UpstreamError) as raised:
        await client.complete(REQ)
    assert raised.value.retry_after == 20.0  # when the server said to come back


async def test_a_hanging_answer_times_out(simulator: SimulatorServer, client: OpenAIClient) -> None:
    simulator.sim.config.hang_rate, simulator.sim.config.hang_s = 1.0, 5.0
    with pytest.raises(Timeout) as raised:
        await client.complete(REQ)
    assert raised.value.code == "timeout"


async def test_a_refused_connection_is_an_upstream_error() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    error = await refused(f"http://127.0.0.1:{port}/v1", "k")
    assert isinstance(error, UpstreamError) and error.code == "connection_error"


async def test_an_attempt_may_carry_a_longer_read_timeout_than_the_clients(
    simulator: SimulatorServer,
) -> None:
    """A long prompt on a slow self-hosted server: the guarded client asks for a longer
    read timeout for that attempt (`LLMRequest.timeout_s`), which the client honours."""
    from dataclasses import replace

    from streams.llm.client import LLMRequest

    simulator.sim.config.latency_ms, simulator.sim.config.latency_dist = 800, "fixed"
    client = OpenAIClient(base_url=simulator.base_url, api_key="k", connect_timeout_s=1,
                          read_timeout_s=0.3)  # fmt: skip
    request = LLMRequest(messages=[{"role": "user", "content": "<comment>ok</comment>"}],
                         model="sim-1", params={"max_tokens": 50})  # fmt: skip
    try:
        with pytest.raises(Timeout):
            await client.complete(request)
        answer = await client.complete(replace(request, timeout_s=5.0))
        assert answer.content
    finally:
        await client.close()


@asynccontextmanager
async def _serving(
    route: str, handler: Any, gets: dict[str, Any] | None = None
) -> AsyncIterator[str]:
    """A server on a free loopback port answering POSTs to `route` with `handler` (and
    GETs of each route in `gets` with its handler)."""
    from aiohttp import web

    app = web.Application()
    app.router.add_post(route, handler)
    for path, answer in (gets or {}).items():
        app.router.add_get(path, answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@pytest.fixture
async def gateway() -> AsyncIterator[str]:
    """An OpenAI-compatible gateway that says why it refuses in a header of its own, in
    its users' language (a header value that is not ASCII)."""
    from aiohttp import web

    async def refuse(request: web.Request) -> web.Response:
        status = int(request.match_info["status"])
        body = b'{"error": {"message": "too many requests", "code": "rate_limited"}}'
        return web.Response(status=status, body=body, content_type="application/json",
                            headers={"retry-after": "2", "x-error-detail": "请求过多，请稍后再试"})  # fmt: skip

    async with _serving("/{status}/v1/chat/completions", refuse) as url:
        yield url


@pytest.mark.parametrize(("status", "error"), [(429, RateLimited), (503, UpstreamError)])
async def test_an_error_answer_with_a_header_that_is_not_ascii_is_mapped_as_any(
    gateway: str, status: int, error: type[TaskError]
) -> None:
    """The SDK's exception is built over the answer's headers: one that is not ASCII made
    the build fail (UnicodeEncodeError), and every refusal of such a gateway an internal
    error — never retried, never told to the limiter or the breaker."""
    c = OpenAIClient(base_url=f"{gateway}/{status}/v1", api_key="k", connect_timeout_s=1,
                     read_timeout_s=1)  # fmt: skip
    try:
        with pytest.raises(error) as raised:
            await c.complete(REQ)
    finally:
        await c.close()
    if status == 429:
        assert raised.value.retry_after == 2.0


@pytest.fixture
async def flood() -> AsyncIterator[str]:
    """A server (or a proxy before it) answering a chat completion with more than any
    completion is: said in its Content-Length, sent in chunks without one, or gzipped
    small on the wire and large once unzipped; `/{status}/...` answers with that status."""
    from aiohttp import web

    big = orjson.dumps({"choices": [{"message": {"content": "x" * 5_000}}]})

    async def answer(request: web.Request) -> web.StreamResponse:
        status, how = int(request.match_info["status"]), request.match_info["how"]
        if how == "length":
            return web.Response(status=status, body=big, content_type="application/json")
        response = web.StreamResponse(status=status)
        if how == "gzip":
            response.headers["Content-Encoding"] = "gzip"
            response.content_length = len(packed := gzip.compress(big))
            await response.prepare(request)
            await response.write(packed)
            return response
        response.enable_chunked_encoding()
        await response.prepare(request)
        for i in range(0, len(big), 512):
            await response.write(big[i : i + 512])
        return response

    async with _serving("/{how}/{status}/v1/chat/completions", answer) as url:
        yield url


@pytest.mark.parametrize("how", ["length", "chunked", "gzip"])
async def test_an_answer_larger_than_any_completion_is_cut_off_not_read_whole(
    flood: str, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An endless body, or a gzip bomb, was read into memory whole: the worker's memory
    was the server's to fill. It is read up to MAX_RESPONSE_BYTES (here 4 KB), then the
    call is an upstream error saying so; an error status over it is still that status."""
    monkeypatch.setattr(openai_client, "MAX_RESPONSE_BYTES", 4_096)
    for status, error, code in [(200, UpstreamError, "response_too_large"),
                                (503, UpstreamError, None), (429, RateLimited, None)]:  # fmt: skip
        c = OpenAIClient(base_url=f"{flood}/{how}/{status}/v1", api_key="k",
                         connect_timeout_s=1, read_timeout_s=1)  # fmt: skip
        try:
            with pytest.raises(error) as raised:
                await c.complete(REQ)
        finally:
            await c.close()
        if code is not None:
            assert raised.value.code == code and "4096 bytes" in raised.value.message
    monkeypatch.setattr(openai_client, "MAX_RESPONSE_BYTES", 6_000)  # under it: answered
    c = OpenAIClient(base_url=f"{flood}/{how}/200/v1", api_key="k", connect_timeout_s=1,
                     read_timeout_s=1)  # fmt: skip
    try:
        assert (await c.complete(REQ)).content == "x" * 5_000
    finally:
        await c.close()


GEMINI_429 = [{"error": {"code": 429, "status": "RESOURCE_EXHAUSTED", "message": (
    "You exceeded your current quota."), "details": [
    {"@type": "type.googleapis.com/google.rpc.QuotaFailure", "violations": []},
    {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "37s"}]}}]  # fmt: skip
GEMINI_400 = [{"error": {"code": 400, "status": "INVALID_ARGUMENT", "message": (
    "The input token count (1048577) exceeds the maximum number of tokens allowed "
    "(1048576).")}}]  # fmt: skip


async def test_geminis_errors_in_a_list_say_their_wait_and_their_window() -> None:
    """Gemini's OpenAI endpoint answers an error as a list of error objects, and says how
    long to wait in the body (`RetryInfo`), not in a header: the wait was lost (the
    limiter and the retries guessed), and the window of an overflow unread."""
    from aiohttp import web

    async def refuse(request: web.Request) -> web.Response:
        body = GEMINI_429 if request.match_info["status"] == "429" else GEMINI_400
        return web.Response(status=int(request.match_info["status"]), body=orjson.dumps(body),
                            content_type="application/json")  # fmt: skip

    async with _serving("/{status}/v1/chat/completions", refuse) as url:
        for status in (429, 400):
            error = await refused(f"{url}/{status}/v1", "k")
            if status == 429:
                assert isinstance(error, RateLimited) and error.retry_after == 37.0
            else:
                assert isinstance(error, ContextOverflow) and error.window == 1048576
                assert error.prompt_tokens == 1048577


async def test_ollama_is_asked_the_window_it_gave_its_loaded_model() -> None:
    """Ollama answers `/api/show` (no `num_ctx` there unless the modelfile sets one) and
    `/api/ps`, where a loaded model's `context_length` is the window its prompts are cut
    at; llama.cpp's `/props` it has not."""
    from aiohttp import web

    from tests.unit.llm.test_endpoint import OLLAMA_PS

    def json(body: Any) -> web.Response:
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def show(request: web.Request) -> web.Response:
        return json({"parameters": 'stop "<|im_end|>"', "model_info": {}})

    async def models(request: web.Request) -> web.Response:
        return json({"object": "list", "data": [{"id": "qwen2.5:latest", "owned_by": "library"}]})

    async def running(request: web.Request) -> web.Response:
        return json(OLLAMA_PS)

    gets = {"/v1/models": models, "/api/ps": running}
    async with _serving("/api/show", show, gets) as url:
        client = OpenAIClient(base_url=f"{url}/v1", api_key=None, connect_timeout_s=2.0,
                              read_timeout_s=5.0)  # fmt: skip
        try:
            facts = await client.describe("qwen2.5")
        finally:
            await client.close()
    assert (facts.server, facts.context_window) == ("ollama", 4096)


def test_an_error_body_of_any_shape_says_what_it_can() -> None:
    from streams.llm.error_body import error_object, retry_delay

    assert error_object(GEMINI_429)["code"] == 429 and retry_delay(GEMINI_429) == 37.0
    for body in (None, [], "text", [1], {"error": "text"}, {"error": {"details": "x"}},
                 {"error": {"details": [{"@type": "type.googleapis.com/google.rpc.RetryInfo",
                                         "retryDelay": 37}]}}):  # fmt: skip
        assert retry_delay(body) is None
    assert error_object({"message": "bare"}) == {"message": "bare"}


async def test_a_call_the_server_drops_counts_as_an_attempt(make_processor: Any) -> None:
    """A server that dies of a prompt (an assertion in its code on that input) drops the
    connection with the call on it. That was `connection_error`, an outage that spares
    the task's attempts: the task asked again and again — crashing the server each
    time — until its deadline. Now the attempt counts; refusals still do not."""
    from aiohttp import web

    from streams.contract.records import Source
    from streams.resilience.retry import RetryPolicy

    async def crash(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(status=200)
        response.content_length = 1000
        await response.prepare(request)
        await response.write(b'{"choices": [')
        assert request.transport is not None
        request.transport.close()  # the server process dies mid-answer
        return response

    async with _serving("/v1/chat/completions", crash) as url:
        error = await refused(f"{url}/v1", "k")
        assert isinstance(error, UpstreamError) and error.code == "connection_lost"
        c = OpenAIClient(base_url=f"{url}/v1", api_key="k", connect_timeout_s=1,
                         read_timeout_s=1)  # fmt: skip
        try:
            processor = make_processor(c, policy=RetryPolicy(max_attempts=3,
                                       backoff_base_s=0.001), deadline_s=4)  # fmt: skip
            task = orjson.dumps({"task_id": "t1", "pipeline": "comment-analysis",
                                 "input": {"text": "Fine."}})  # fmt: skip
            out = await processor.process(task, b"t1", Source(topic="t", partition=0, offset=1))
        finally:
            await c.close()
    letter = orjson.loads(out.value)
    assert letter["error"]["code"] == "connection_lost" and letter["attempts"] == 3, letter


async def test_a_rotated_key_file_is_read_again_when_the_key_is_refused(
    simulator: SimulatorServer, tmp_path: Any, make_processor: Any
) -> None:
    """A mounted secret rotated while the worker runs (the old key revoked): the key was
    read once at start, so every call was refused until a restart. On a refusal the
    file is read again; a new key in it is taken up, and the task asked again."""
    from streams.contract.records import Source

    secret = tmp_path / "key"
    secret.write_text("old-key\n")
    simulator.sim.config.api_key = "new-key"
    c = OpenAIClient(base_url=simulator.base_url, api_key="old-key", connect_timeout_s=1,
                     read_timeout_s=2, key_file=secret)  # fmt: skip
    try:
        with pytest.raises(AuthError):  # the file still holds the refused key
            await c.complete(REQ)
        secret.write_text("new-key\n")  # the secret rotated
        task = orjson.dumps({"task_id": "t1", "pipeline": "comment-analysis",
                             "input": {"text": "Fine."}})  # fmt: skip
        out = await make_processor(c).process(task, b"t1", Source(topic="t", partition=0,
                                                                  offset=1))  # fmt: skip
        assert out.kind == "result", orjson.loads(out.value)
        assert orjson.loads(out.value)["attempts"] == 2  # refused, then with the new key
        assert (await c.complete(REQ)).content  # and every call after it
        retired = c._retired  # the old key's session, closed once its calls are done
        assert len(retired) == 1 and not retired[0].closed
    finally:
        await c.close()
    assert retired[0].closed
    assert simulator.sim.snapshot()["by_status"] == {"401": 2, "200": 2}


async def test_calls_in_flight_when_the_key_rotates_are_asked_again(tmp_path: Any) -> None:
    """Three calls go with the old key; all three are refused after the secret rotated.
    The first refusal reads the new key; the other two found it already in use and were
    auth errors — dead letters of calls the new key answers."""
    from aiohttp import web

    arrived: list[str] = []
    all_in, rotated = asyncio.Event(), asyncio.Event()

    async def gate(request: web.Request) -> web.Response:
        said = request.headers.get("Authorization")
        if said == "Bearer new-key":
            body = {"model": "m", "choices": [{"finish_reason": "stop", "message": {
                "role": "assistant", "content": '{"ok": true}'}}]}  # fmt: skip
            return web.json_response(body)
        arrived.append(str(said))
        if len(arrived) == 3:
            all_in.set()
        await rotated.wait()  # refused once all three are in flight and the key rotated
        return web.json_response({"error": {"message": "Incorrect API key provided.",
                                            "code": "invalid_api_key"}}, status=401)  # fmt: skip

    secret = tmp_path / "key"
    secret.write_text("old-key\n")
    async with _serving("/v1/chat/completions", gate) as url:
        c = OpenAIClient(base_url=f"{url}/v1", api_key="old-key", connect_timeout_s=1,
                         read_timeout_s=2, key_file=secret)  # fmt: skip
        try:
            calls = [asyncio.ensure_future(c.complete(REQ)) for _ in range(3)]
            await asyncio.wait_for(all_in.wait(), 5)
            secret.write_text("new-key\n")  # rotated while they are in flight
            rotated.set()
            refused = await asyncio.gather(*calls, return_exceptions=True)
            assert all(isinstance(e, UpstreamError) and e.code == "key_rotated"
                       for e in refused), refused  # fmt: skip
            assert (await c.complete(REQ)).content == '{"ok": true}'
        finally:
            await c.close()
