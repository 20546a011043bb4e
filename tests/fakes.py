"""Fakes for unit tests: an LLM client for the core and the resilience layer that
answers, fails or hangs as each test scripts it, with no HTTP and no simulator; and a
schema registry (Confluent's REST API) that can fail or hang on command."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from streams.errors import TaskError
from streams.llm.client import LLMRequest, LLMResponse

Behaviour = Callable[[LLMRequest], LLMResponse | TaskError | None]

# One small call to the LLM simulator (tests of the HTTP client and the guarded client).
SIM_REQUEST = LLMRequest(
    messages=[{"role": "user", "content": "<comment>great</comment>"}],
    model="sim-1",
    params={"max_tokens": 50},
)


def answer(content: object, *, prompt_tokens: int = 10, completion_tokens: int = 5,
           model: str = "fake-1") -> LLMResponse:  # fmt: skip
    text = content if isinstance(content, str) else orjson.dumps(content).decode()
    return LLMResponse(content=text, model=model, prompt_tokens=prompt_tokens,
                       completion_tokens=completion_tokens, finish_reason="stop")  # fmt: skip


class FakeLLM:
    """`LLMClient` whose every call does what `behaviour` says: return an answer, raise
    an error, or hang (None) until `release()` or cancellation."""

    def __init__(self, behaviour: Behaviour | None = None) -> None:
        self.behaviour: Behaviour = behaviour or (lambda _r: answer({"ok": True}))
        self.requests: list[LLMRequest] = []
        self.in_flight = 0
        self.cancelled = 0
        self._released = asyncio.Event()
        self._called = asyncio.Event()

    @property
    def endpoint(self) -> str:
        return "fake://llm"

    async def called(self, n: int) -> None:
        """Return once `n` calls have reached the endpoint."""
        while len(self.requests) < n:
            self._called.clear()
            await self._called.wait()

    def release(self) -> None:
        """Let every hanging call (and later ones that would hang) answer."""
        self._released.set()

    async def complete(self, request: LLMRequest) -> LLMResponse:
        self.requests.append(request)
        self._called.set()
        self.in_flight += 1
        try:
            outcome = self.behaviour(request)
            while outcome is None:
                await self._released.wait()
                self._released.clear()
                outcome = self.behaviour(request)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1
        if isinstance(outcome, TaskError):
            raise outcome
        return outcome

    async def close(self) -> None:
        return None


class FakeRegistry:
    """Confluent's `/schemas/ids/{id}` and `/subjects/{s}/versions/{v}`, with faults."""

    def __init__(self) -> None:
        self.schemas: dict[int, dict[str, Any]] = {}
        self.subjects: dict[tuple[str, str], dict[str, Any]] = {}
        self.fail_next = 0  # answer this many requests with 503
        self.hold = asyncio.Event()  # cleared: requests wait (a registry that hangs)
        self.hold.set()
        self.requests: list[str] = []
        app = web.Application()
        app.router.add_get("/schemas/ids/{id}", self._by_id)
        app.router.add_get("/subjects/{subject}/versions/{version}", self._by_subject)
        app.router.add_get("/subjects", self._subjects)
        self.runner = web.AppRunner(app)
        self.url = ""

    async def start(self) -> None:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def _gate(self, request: web.Request) -> web.Response | None:
        self.requests.append(request.path)
        await self.hold.wait()
        if self.fail_next:
            self.fail_next -= 1
            return web.Response(status=503, text="unavailable")
        return None

    async def _by_id(self, request: web.Request) -> web.Response:
        failed = await self._gate(request)
        if failed is not None:
            return failed
        found = self.schemas.get(int(request.match_info["id"]))
        if found is None:
            return web.json_response({"error_code": 40403, "message": "Schema not found"},
                                     status=404)  # fmt: skip
        return web.json_response(found)

    async def _by_subject(self, request: web.Request) -> web.Response:
        failed = await self._gate(request)
        if failed is not None:
            return failed
        found = self.subjects.get((request.match_info["subject"], request.match_info["version"]))
        if found is None:
            return web.json_response({"error_code": 40401}, status=404)
        return web.json_response(found)

    async def _subjects(self, request: web.Request) -> web.Response:
        return web.json_response([])
