"""The LLM endpoint checked before the worker starts, as Kafka is (`kafka.security`):
reachable, the key accepted, the model listed — a wrong host or a refused key one line
naming the setting, within seconds, instead of every task's first call failing; an
endpoint merely away (refused, unanswered: a server restarting) waited for, with
backoff and a line per try, up to `llm.startup_wait_s`."""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

import aiohttp

from streams.errors import ConfigError, UpstreamError
from streams.llm.deployments import Deployment, load_deployments
from streams.llm.endpoint import EndpointFacts
from streams.llm.openai_client import OpenAIClient
from streams.pipelines.registry import PipelineRegistry
from streams.resilience.retry import retry_transient
from streams.settings import Settings

log = logging.getLogger(__name__)

KEY_VARS = "OPENAI_API_KEY (or LLM_STREAMS_LLM__API_KEY)"
URL_VARS = "OPENAI_BASE_URL (or LLM_STREAMS_LLM__BASE_URL)"


class EndpointAway(UpstreamError):
    """The endpoint could not be reached, for a reason waiting may mend."""


async def llm_preflight(settings: Settings, registry: PipelineRegistry | None = None) -> Preflight:
    """The endpoint's models and what it says of itself, once it answers with the key
    accepted; raises ConfigError naming the setting when it never will. With a
    deployments file, its deployments are checked too (`_deployments`); when they serve
    the default model, they stand in for the default endpoint. A model the endpoint does
    not list — the default, or one `registry`'s versions name — is said (`_unlisted`)."""
    llm = settings.llm
    deployments = load_deployments(llm.deployments_file) if llm.deployments_file else []
    served = [d for d in deployments if d.spec.model == llm.model]
    if served:
        return await _deployments(settings, deployments, served)
    key = llm.api_key.get_secret_value() if llm.api_key else None
    if llm.base_url is None and not key:
        raise ConfigError(f"no LLM key: set {KEY_VARS}, or {URL_VARS} for a server that "
                          "needs none")  # fmt: skip
    client = OpenAIClient(base_url=llm.base_url, api_key=key,
                          connect_timeout_s=llm.connect_timeout_s,
                          read_timeout_s=llm.read_timeout_s)  # fmt: skip
    where = client.endpoint

    async def ask() -> list[str]:
        return await _ask(client, where)

    try:
        ids = await retry_transient(
            ask, what="the LLM endpoint at start (LLM_STREAMS_LLM__STARTUP_WAIT_S bounds the "
            "wait)", transient=lambda exc: isinstance(exc, EndpointAway),
            within_s=llm.startup_wait_s, first_s=1.0, max_s=15.0,
        )  # fmt: skip
        facts = await client.describe(llm.model)
    except EndpointAway as exc:
        raise ConfigError(f"{exc.message}: still away after {llm.startup_wait_s:.0f}s — check "
                          f"{URL_VARS}") from exc  # fmt: skip
    finally:
        await client.close()
    _unlisted(settings, registry, deployments, where, ids)
    if deployments:
        await _deployments(settings, deployments, [])
    return Preflight(endpoint=where, models=ids, facts=facts)


def _unlisted(
    settings: Settings,
    registry: PipelineRegistry | None,
    deployments: list[Deployment],
    where: str,
    ids: list[str],
) -> None:
    """Say each model asked of the endpoint that it does not list: the default (check
    the setting), and those the pipelines' versions name (their `model:`) — the endpoint
    refuses their calls (404), so their tasks would wait for the model's circuit
    (`resilience.guarded`) and end as `circuit_open` dead letters. A server that
    lists one model alone (llama.cpp) answers whatever name is asked: nothing to say."""
    if len(ids) < 2:
        return
    default = settings.llm.model
    shown = ", ".join(ids[:8])
    if default not in ids:
        log.warning("the LLM endpoint %s lists no model %r (it lists %s): check "
                    "LLM_STREAMS_LLM__MODEL", where, default, shown)  # fmt: skip
    deployed = {d.spec.model for d in deployments}  # their own endpoints serve them
    for model, versions in (registry.models_used(default) if registry else {}).items():
        if model in ids or model in deployed or model == default:
            continue
        named = "; ".join(f"{v.pipeline.name} {v.version}" for v in versions)
        log.warning("the LLM endpoint %s lists no model %r, which %s ask(s) for (it lists "
                    "%s): their calls would be refused; check their `model:`",
                    where, model, named, shown)  # fmt: skip


async def _deployments(
    settings: Settings, deployments: list[Deployment], served: list[Deployment]
) -> Preflight:
    """Each deployment tried once: a refused key or a name that does not resolve is a
    ConfigError naming the deployment; one away is said and left to its breaker — unless
    every one of the default model's (`served`) is away, which is waited for as an
    endpoint alone is."""
    llm = settings.llm
    file = f"{llm.deployments_file} (LLM_STREAMS_LLM__DEPLOYMENTS_FILE)"
    clients = {d.name: OpenAIClient.of_deployment(d, connect_timeout_s=llm.connect_timeout_s,
                                                  read_timeout_s=llm.read_timeout_s)
               for d in deployments}  # fmt: skip
    hint = (f"the key of its entry in {file}", f"its base_url in {file}")

    async def answered(names: list[str]) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        away: list[str] = []
        for name in names:
            try:
                found[name] = await _ask(
                    clients[name], f"deployment {name} ({clients[name].endpoint})", hint
                )
            except EndpointAway as exc:
                away.append(exc.message)
        if served and not any(d.name in found for d in served):
            raise EndpointAway("; ".join(away))
        for said in away:
            log.warning("%s: its calls wait for it (its breaker) while the others answer", said)
        return found

    try:
        found = await retry_transient(
            lambda: answered([d.name for d in deployments]),
            what="the deployments at start (LLM_STREAMS_LLM__STARTUP_WAIT_S bounds the wait)",
            transient=lambda exc: isinstance(exc, EndpointAway),
            within_s=llm.startup_wait_s, first_s=1.0, max_s=15.0,
        )  # fmt: skip
        for d in deployments:  # a deployment's calls for a model it lacks go to others
            listed = found.get(d.name, [])
            if len(listed) > 1 and d.provider_model not in listed:
                log.warning("deployment %s (%s) lists no model %r (it lists %s): its calls "
                            "would be refused, and left to the model's other deployments; "
                            "check its model or provider_model in %s", d.name,
                            clients[d.name].endpoint, d.provider_model, ", ".join(listed[:8]),
                            file)  # fmt: skip
        first = next((d for d in served if d.name in found), None)
        facts = await clients[first.name].describe(first.provider_model) if first else None
    except EndpointAway as exc:
        raise ConfigError(f"{exc.message}: still away after {llm.startup_wait_s:.0f}s — check "
                          f"{file}") from exc  # fmt: skip
    finally:
        for client in clients.values():
            await client.close()
    where = ", ".join(f"{d.name} {clients[d.name].endpoint}" for d in served or deployments)
    return Preflight(endpoint=f"deployments {where}", models=sorted({m for ids in found.values()
                                                                      for m in ids}),
                     facts=facts or EndpointFacts())  # fmt: skip


@dataclass(frozen=True)
class Preflight:
    """What the endpoint answered at start."""

    endpoint: str
    models: list[str]
    facts: EndpointFacts


def banner(settings: Settings, registry: PipelineRegistry, seen: Preflight) -> list[str]:
    """What the worker says when it starts: where it reads and writes, what it answers
    with, how, and where to look."""
    llm, t, facts = settings.llm, settings.topics, seen.facts
    window = (f"{llm.context_window} (set)" if llm.context_window else
              f"{facts.context_window} (said)" if facts.context_window else
              "learned from the first overflow")  # fmt: skip
    slots = f", {facts.slots} slots" if facts.slots else ""
    server = f" ({facts.server})" if facts.server else ""
    pipelines = "; ".join(
        f"{name} {'/'.join(sorted(p.versions))} (default {p.spec.default_version})"
        for name, p in sorted(registry.pipelines.items())
    )
    host = "127.0.0.1" if settings.web_bind in ("0.0.0.0", "::") else settings.web_bind
    sources = sorted(registry.sources())
    sinks = sorted(registry.sinks())
    return [
        f"llm-streams worker {settings.app_id}: Kafka {settings.kafka.broker_url}, "
        f"{settings.processing_guarantee}",
        f"  LLM {seen.endpoint}{server}, model {llm.model}, window {window}{slots}",
        f"  pipelines: {pipelines}",
        f"  reads {t.tasks} (live), {t.replay} (replay)"
        + (f", sources {', '.join(sources)}" if sources else "")
        + f"; writes {t.results}, {t.dead_letters}, {t.review}"
        + (f", sinks {', '.join(sinks)}" if sinks else ""),
        f"  store {settings.store} in {settings.data_dir}",
        f"  status http://{host}:{settings.web_port}/status (metrics /metrics)",
    ]


async def _ask(
    client: OpenAIClient, where: str, check: tuple[str, str] = (KEY_VARS, URL_VARS)
) -> list[str]:
    """One try: the models listed, or why not — `EndpointAway` when waiting may mend it.
    `check`: what to check for a refused key, and for a name that does not resolve."""
    key_vars, url_vars = check
    try:
        status, ids = await client.models()
    except socket.gaierror as exc:
        if exc.errno == socket.EAI_AGAIN:  # the resolver is away, not the name wrong
            raise EndpointAway(f"{where}: {exc}") from exc
        raise ConfigError(f"the LLM endpoint {where} does not resolve ({exc}): check "
                          f"{url_vars}") from exc  # fmt: skip
    except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, TimeoutError,
            ConnectionError) as exc:  # fmt: skip
        if isinstance(getattr(exc, "os_error", None), socket.gaierror):
            raise ConfigError(f"the LLM endpoint {where} does not resolve: check "
                              f"{url_vars}") from exc  # fmt: skip
        raise EndpointAway(f"cannot reach the LLM endpoint {where}: {exc}") from exc
    if status in (401, 403):
        raise ConfigError(f"the LLM endpoint {where} refused the key (HTTP {status}): "
                          f"check {key_vars}")  # fmt: skip
    if status >= 500:
        raise EndpointAway(f"the LLM endpoint {where} answered HTTP {status}")
    if status == 404 and not client.endpoint.rstrip("/").endswith("/v1"):
        await _without_v1(client, where, url_vars)
    return ids  # 404 and the like: a server without a model list says nothing more


async def _without_v1(client: OpenAIClient, where: str, url_vars: str) -> None:
    """An endpoint with no `/models` whose `/v1/models` lists models was given without its
    `/v1` (vLLM, LiteLLM, Ollama serve their OpenAI routes there alone): every call would
    be refused (404) — one line naming the setting, not every task's model circuit."""
    try:
        status, ids = await client.models(path="/v1/models")
    except (OSError, aiohttp.ClientError, TimeoutError):
        return
    if status == 200 and ids:
        fixed = client.endpoint.rstrip("/") + "/v1"
        raise ConfigError(f"the LLM endpoint {where} has no /models, but {fixed}/models "
                          f"lists {', '.join(ids[:4])}: its OpenAI routes are under /v1 — "
                          f"set {url_vars} to {fixed}")  # fmt: skip


__all__ = ["EndpointAway", "Preflight", "banner", "llm_preflight"]
