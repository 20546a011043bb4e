"""A fake LLM client for unit tests of the core and the resilience layer: it answers,
fails or hangs as each test scripts it, with no HTTP and no simulator."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import orjson

from streams.errors import TaskError
from streams.llm.client import LLMRequest, LLMResponse

Behaviour = Callable[[LLMRequest], LLMResponse | TaskError | None]


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
