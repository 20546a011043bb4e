"""One guarded client per endpoint and model: the primary and any fallbacks.

Breakers are per endpoint (an outage hits every model behind it); limiters per
endpoint and model (providers limit each model separately); HTTP clients per
endpoint and key.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from streams.llm.client import LLMClient
from streams.llm.endpoint import ContextWindow
from streams.observability.metrics import Metrics
from streams.resilience.breaker import CircuitBreaker
from streams.resilience.concurrency import ConcurrencyLimit
from streams.resilience.guarded import GuardedClient
from streams.resilience.limiter import RateLimiter


class ClientPool:
    def __init__(
        self,
        *,
        base_url: str | None,
        api_key: str | None,
        make_http: Callable[[str | None, str | None], LLMClient],
        make_limiter: Callable[[], RateLimiter],
        make_breaker: Callable[[str], CircuitBreaker],
        metrics: Metrics | None = None,
        slow_call_s: float = 10.0,
        context_window: int | None = None,
        read_timeout_s: float | None = None,
        max_concurrency: int = 10_000,
    ) -> None:
        self.base_url = base_url
        self.api_key = api_key
        self.make_http = make_http
        self.make_limiter = make_limiter
        self.make_breaker = make_breaker
        self.metrics = metrics or Metrics()  # none given: one nobody scrapes
        self.slow_call_s = slow_call_s
        self.context_window = context_window  # the setting: wins over what is learned
        self.read_timeout_s = read_timeout_s
        self.max_concurrency = max_concurrency
        self._concurrency: dict[str, ConcurrencyLimit] = {}
        self._http: dict[tuple[str | None, str | None], LLMClient] = {}
        self._breakers: dict[str, CircuitBreaker] = {}
        self._guarded: dict[tuple[str | None, str | None, str], GuardedClient] = {}

    def get(self, base_url: str | None, api_key: str | None, model: str) -> GuardedClient:
        key = (base_url, api_key, model)
        if key not in self._guarded:
            http = self._http.get((base_url, api_key))
            if http is None:
                http = self._http[(base_url, api_key)] = self.make_http(base_url, api_key)
            name = http.endpoint
            breaker = self._breakers.get(name)
            if breaker is None:
                breaker = self._breakers[name] = self.make_breaker(name)
                metrics = self.metrics
                breaker.on_change = lambda n, _old, new: metrics.breaker_changed(n, new.value)
                metrics.breaker_changed(name, breaker.state.value)
            # Calls at once, like the breaker, per endpoint: a server's slots serve every model.
            gate = self._concurrency.get(name)
            if gate is None:
                gate = self._concurrency[name] = ConcurrencyLimit(
                    max_limit=self.max_concurrency, name=name
                )
                self.metrics.watch_endpoint(name, gate.current_limit, gate.waiting_calls)
            limiter = self.make_limiter()
            self.metrics.watch_limiter(model, limiter.rates)
            self._guarded[key] = GuardedClient(
                http, limiter=limiter, breaker=breaker, metrics=self.metrics,
                slow_call_s=self.slow_call_s, concurrency=gate,
                window=ContextWindow(self.context_window, name=f"{name} {model}"),
                read_timeout_s=self.read_timeout_s,
            )  # fmt: skip
        return self._guarded[key]

    def primary(self, model: str) -> GuardedClient:
        return self.get(self.base_url, self.api_key, model)

    def for_model(
        self, model: str, base_url: str | None = None, api_key_env: str | None = None
    ) -> GuardedClient:
        """The client of `model` on the primary endpoint, or on `base_url` with the key in
        the environment variable `api_key_env` (a pipeline's fallback on another endpoint)."""
        if base_url is None:
            return self.get(self.base_url, self.api_key, model)
        key = os.environ.get(api_key_env) if api_key_env else None
        return self.get(base_url, key, model)

    async def close(self) -> None:
        for http in self._http.values():
            await http.close()
