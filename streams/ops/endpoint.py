"""What the configured LLM endpoint is and honours, for `llm-streams pipelines validate
--endpoint`: per model the pipeline versions use, what the endpoint — or each of the
model's deployments — says of itself (server, window, slots) and each structured-output
way tried once."""

from __future__ import annotations

from streams.llm.deployments import by_model, load_deployments
from streams.llm.openai_client import OpenAIClient
from streams.pipelines.registry import PipelineRegistry
from streams.settings import Settings


async def endpoint_report(settings: Settings, registry: PipelineRegistry) -> list[str]:
    llm = settings.llm
    key = llm.api_key.get_secret_value() if llm.api_key else None
    client = OpenAIClient(base_url=llm.base_url, api_key=key,
                          connect_timeout_s=llm.connect_timeout_s,
                          read_timeout_s=llm.read_timeout_s)  # fmt: skip
    deployed = by_model(load_deployments(llm.deployments_file) if llm.deployments_file else [])
    lines: list[str] = []
    opened = [client]
    try:
        for model, used in sorted(registry.models_used(llm.model).items()):
            versions = [f"{v.pipeline.name} {v.version} ({v.spec.response_format})" for v in used]
            # A model with deployments: each of them, by the name its provider knows.
            serving = [(f"deployment {d.name} ", d.provider_model, OpenAIClient.of_deployment(
                d, connect_timeout_s=llm.connect_timeout_s, read_timeout_s=llm.read_timeout_s))
                for d in deployed.get(model, [])] or [("", model, client)]  # fmt: skip
            opened += [c for _, _, c in serving if c is not client]
            for label, asked, at in serving:
                await _describe(lines, f"{label}endpoint {at.endpoint} model {model}", at, asked)
            lines.append("  used by " + "; ".join(versions))
    finally:
        for each in opened:
            await each.close()
    return lines


async def _describe(lines: list[str], where: str, client: OpenAIClient, model: str) -> None:
    facts = await client.describe(model)
    tried = await client.structured_support(model)
    if facts.unloaded:  # loaded by the tries (Ollama): the window it was given is said now
        facts = await client.describe(model)
    window = facts.context_window or "not said (learned from an overflow)"
    lines.append(f"{where}: server {facts.server or 'not said'}, window {window}, "
                 f"slots {facts.slots or 'not said'}")  # fmt: skip
    lines += [f"  {mode}: {verdict}" for mode, verdict in tried.items()]


__all__ = ["endpoint_report"]
