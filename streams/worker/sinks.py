"""The pipelines' sinks at start: each sink topic made when missing and its partitions
read (`kafka.topics.ensure_sinks`), and, for a sink with `format: json_schema`, its
value schema registered under `<topic>-value` (JSON Schema, or Avro for `format:
avro`) — a schema the subject's compatibility rule refuses (a changed output schema)
stops the start with the registry's words."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp

from streams.core.sinks import framing, registered_schema
from streams.errors import ConfigError
from streams.kafka.limits import WriteLimits
from streams.kafka.topics import ensure_sinks
from streams.pipelines.registry import PipelineRegistry
from streams.pipelines.sinks import SinkSpec
from streams.pipelines.specs import PipelineSpec
from streams.schema_registry import RegistryClient, RegistryRefused, UnknownSchema
from streams.settings import Settings

# Offline, an enriched Avro sink's source schema is not known: what it adds is checked
# over a record of no fields (the source's own are read from the registry at start).
_SOME_RECORD = {"type": "record", "name": "Source", "fields": []}


def sink_problem(spec: SinkSpec, output_schema: dict[str, Any]) -> str | None:
    """What keeps a sink's records from being written as it says (its value schema cannot
    be derived: Avro cannot say the answer's schema), or None."""
    try:
        registered_schema(spec, output_schema, _SOME_RECORD)
    except ConfigError as exc:
        return str(exc)
    return None


async def prepare_sinks(settings: Settings, registry: PipelineRegistry) -> WriteLimits:
    """What the written sink topics take: their partition counts and, for those in the
    registry's format, their framing (the bytes each takes are read with the worker's
    other topics')."""
    partitions = await ensure_sinks(settings, registry.sinks(), list(registry.sources()))
    return WriteLimits(partitions=partitions, framing=await register_schemas(settings, registry))


async def register_schemas(
    settings: Settings, registry: PipelineRegistry
) -> dict[str, Callable[[bytes], bytes]]:
    """Sink topic -> its framing, for the sinks with format json_schema or avro: their
    value schemas registered under `<topic>-value`."""
    sinks = {p.spec.sink.topic: p for p in registry.pipelines.values()
             if p.spec.sink is not None and p.spec.sink.format != "json"}  # fmt: skip
    if not sinks:
        return {}
    if settings.schema_registry.url is None:
        raise ConfigError(f"sinks {sorted(sinks)} are in the schema registry's format: set "
                          "LLM_STREAMS_SCHEMA_REGISTRY__URL")  # fmt: skip
    client = RegistryClient(settings.schema_registry)
    try:
        found = {}
        for topic, pipeline in sorted(sinks.items()):
            spec = pipeline.spec.sink
            assert spec is not None
            source = await _source_schema(client, pipeline.spec)
            kind, schema = registered_schema(spec, pipeline.output_schema, source)
            schema_id = await client.register(f"{topic}-value", schema, kind)
            found[topic] = framing(kind, schema, schema_id)
        return found
    except UnknownSchema as exc:
        why = f"schema registry: no schema under {exc} for an enriched Avro sink's source"
        raise ConfigError(why) from exc
    except RegistryRefused as exc:
        raise ConfigError(f"schema registry: {exc}") from exc
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ConfigError(f"schema registry {settings.schema_registry.url} does not answer: "
                          f"{type(exc).__name__}: {exc}") from exc  # fmt: skip
    finally:
        await client.close()


async def _source_schema(client: RegistryClient, spec: PipelineSpec) -> dict[str, Any] | None:
    """An enriched Avro sink's source schema: the latest under `<source topic>-value`
    (records written since with an older schema are written with it: Avro fills what
    they lack from its defaults, or the record's task is dead-lettered); None for others."""
    sink = spec.sink
    if sink is None or sink.format != "avro" or sink.shape != "enriched" or spec.source is None:
        return None
    subject = f"{spec.source.topics[0]}-value"
    kind, schema = await client.latest(subject)
    if kind != "AVRO":
        raise ConfigError(f"an enriched Avro sink's source has {kind} values ({subject}): use "
                          "format json_schema for the sink")  # fmt: skip
    return schema


__all__ = ["prepare_sinks", "register_schemas", "sink_problem"]
