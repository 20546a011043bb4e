"""One guarded client per endpoint and model: the primary and any fallbacks; and one
per declared deployment (`llm.deployments`), with the route among a model's.

Breakers are per endpoint (an outage hits every model behind it), and per model on
the default endpoint once it says it does not serve one (`GuardedClient._not_served`);
limiters per endpoint and model (providers limit each model separately); HTTP clients
per endpoint and key. A declared deployment has its own of each: its own key, limits,
health and concurrency.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from functools import partial

from streams.llm.client import LLMClient
from streams.llm.deployments import DEFAULT, Deployment, by_model
from streams.llm.endpoint import ContextWindow
from streams.observability.metrics import Metrics
from streams.resilience.breaker import CircuitBreaker
from streams.resilience.concurrency import ConcurrencyLimit
from streams.resilience.guarded import GuardedClient
from streams.resilience.limiter import RateLimiter
from streams.resilience.router import Member, Route


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
        deployments: list[Deployment] | None = None,
        make_deployed: Callable[[Deployment], LLMClient] | None = None,
        make_deployed_limiter: Callable[[Deployment], RateLimiter] | None = None,
        capped: Callable[[str], float] | None = None,
    ) -> None:
        """`capped`: seconds until a deployment (by name) is under its spend caps again
        (`core.budget.Budgets.deployment_wait`)."""
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
        self.deployments = by_model(deployments or [])
        self.make_deployed = make_deployed
        self.make_deployed_limiter = make_deployed_limiter
        self._routes: dict[str, Route] = {}
        self.capped = capped

    def get(self, base_url: str | None, api_key: str | None, model: str) -> GuardedClient:
        key = (base_url, api_key, model)
        if key not in self._guarded:
            http = self._http.get((base_url, api_key))
            if http is None:
                http = self._http[(base_url, api_key)] = self.make_http(base_url, api_key)
            name = http.endpoint
            limiter = self.make_limiter()
            self.metrics.watch_limiter(model, limiter.rates)
            self._guarded[key] = self._guard(http, name, model, limiter)
        return self._guarded[key]

    def _guard(
        self,
        http: LLMClient,
        name: str,
        model: str,
        limiter: RateLimiter,
        deployment: Deployment | None = None,
    ) -> GuardedClient:
        """`http` guarded by the breaker and the concurrency limit of `name` (made at
        first use) and by `limiter`."""
        breaker = self._breaker(name)
        # Calls at once, like the breaker, per endpoint: a server's slots serve every model.
        gate = self._concurrency.get(name)
        if gate is None:
            gate = self._concurrency[name] = ConcurrencyLimit(
                max_limit=self.max_concurrency, name=name
            )
            self.metrics.watch_endpoint(name, gate.current_limit, gate.waiting_calls)
        return GuardedClient(
            http, limiter=limiter, breaker=breaker, metrics=self.metrics,
            slow_call_s=self.slow_call_s, concurrency=gate,
            window=ContextWindow(self.context_window, name=f"{name} {model}"),
            read_timeout_s=self.read_timeout_s,
            deployment=deployment.name if deployment is not None else DEFAULT,
            provider_model=deployment.provider_model if deployment is not None else None,
            make_breaker=self._breaker if deployment is None else None,
        )  # fmt: skip

    def _breaker(self, name: str) -> CircuitBreaker:
        """The breaker named `name`, made at first use, its state in the metrics (and so in
        the status page and `/readyz`) from then on: one per name, whichever client asks
        (a model's on an endpoint is one, whatever key its clients call it with)."""
        found = self._breakers.get(name)
        if found is not None:
            return found
        breaker = self._breakers[name] = self.make_breaker(name)
        metrics = self.metrics
        breaker.on_change = lambda n, _old, new: metrics.breaker_changed(n, new.value)
        metrics.breaker_changed(name, breaker.state.value)
        return breaker

    def route(self, model: str) -> Route | None:
        """The route among the deployments declared for `model` (None: none are)."""
        found = self._routes.get(model)
        if found is not None or model not in self.deployments:
            return found
        if self.make_deployed is None or self.make_deployed_limiter is None:
            raise ValueError("deployments need make_deployed and make_deployed_limiter")
        members = []
        for deployment in self.deployments[model]:
            limiter = self.make_deployed_limiter(deployment)
            self.metrics.watch_deployment(deployment.name, model, limiter.rates)
            http = self.make_deployed(deployment)
            self._http[(deployment.name, None)] = http  # closed with the rest
            client = self._guard(http, deployment.name, model, limiter, deployment)
            member = Member(deployment.name, client, deployment.spec.weight)
            if self.capped is not None:
                member = replace(member, capped=partial(self.capped, deployment.name))
            members.append(member)
        route = self._routes[model] = Route(model, members)
        return route

    def primary(self, model: str) -> GuardedClient:
        """The client prompts of `model` are fitted by: its first deployment's, if any."""
        route = self.route(model)
        if route is not None:
            return route.primary
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
