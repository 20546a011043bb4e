"""Records in Confluent's wire format (a 0 byte, a 4-byte schema id, then the body),
decoded with the schemas of a schema registry; pipelines' `source: {format: registry}`.

    decoder = RecordDecoder(RegistryClient(settings.schema_registry), metrics)
    document = await decoder.decode(value)   # a JSON-ready object, or InvalidInput

Avro bodies are read with fastavro, JSON Schema bodies parsed and validated against their
schema (either's references to other subjects resolved through the registry). Protobuf
is refused (as invalid input, with the reason). Decoded values are made JSON-ready: bytes and
fixed as base64, decimals as exact strings, dates and times in ISO 8601, so results
stay JSON and a slot of any Avro type can be written.

A schema id the registry does not know, a body that does not decode, and a JSON body
that fails its schema are invalid input (codes source_not_framed,
source_schema_unknown, source_undecodable, source_schema_mismatch,
source_schema_type): a dead letter with the reason. A registry that does not answer
(refused, timed out, 5xx, 401/403, 429) is not the record's fault: the lookup waits
and tries again, backing off to `retry_max_s`, until it answers or the worker stops
(a cancelled lookup ends at once). Schemas are kept in an LRU of `cache_size` ids
(ids never change meaning in a registry); an unknown id is remembered for
`unknown_ttl_s`, so a burst of records with one bad id asks once. Concurrent lookups
of one id share one request.

Written here rather than taken from confluent-kafka's schema_registry package: that
client is synchronous (or, in its async form, tied to its own HTTP stack and to
librdkafka's wheel), and this needs one GET with the retry and single-flight rules
above; the decoding itself is fastavro's and jsonschema's.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import io
import logging
import ssl
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any
from urllib.parse import quote, urljoin

import aiohttp
import fastavro
import jsonschema
import orjson
import referencing
import referencing.exceptions
import referencing.jsonschema
from fastavro.types import Schema as AvroSchema

from streams.contract.records import MAX_DEPTH, record_json, shallow
from streams.errors import InvalidInput
from streams.observability.metrics import Metrics
from streams.settings import SchemaRegistrySettings

log = logging.getLogger(__name__)

MAGIC = 0
HEADER_BYTES = 5
_MAX_REFERENCE_DEPTH = 16


class UnknownSchema(Exception):
    """The registry answered that it has no such schema."""


async def _said(reply: aiohttp.ClientResponse) -> str:
    """The start of what the registry answered, for a message."""
    return (await reply.text())[:200]


class RegistryRefused(Exception):
    """The registry answered the start-up check with an error status."""


@dataclass(frozen=True)
class Schema:
    """A schema as the decoder uses it: `kind` AVRO, JSON or PROTOBUF."""

    id: int
    kind: str
    avro: AvroSchema | None = None
    validator: Any = None
    # Avro: its values may decode far beyond their bytes (`AvroBounds.unbounded`)
    unbounded: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        if self.avro is not None:
            object.__setattr__(self, "unbounded", AvroBounds(self.avro).unbounded())


class RegistryClient:
    """The registry's REST API: schemas by id, with their references."""

    def __init__(self, settings: SchemaRegistrySettings, metrics: Metrics | None = None) -> None:
        if settings.url is None:
            raise ValueError("RegistryClient needs LLM_STREAMS_SCHEMA_REGISTRY__URL")
        self.settings = settings
        self.url = settings.url.rstrip("/")
        self.metrics = metrics
        self._cache: OrderedDict[int, Schema] = OrderedDict()
        self._unknown: dict[int, float] = {}
        self._inflight: dict[int, asyncio.Task[Schema]] = {}
        self._session: aiohttp.ClientSession | None = None

    async def schema(self, schema_id: int) -> Schema:
        """The schema of `schema_id`. Raises UnknownSchema; waits out registry outages."""
        found = self._cache.get(schema_id)
        if found is not None:
            self._cache.move_to_end(schema_id)
            self._count("cached")
            return found
        loop = asyncio.get_running_loop()
        since = self._unknown.get(schema_id)
        if since is not None and loop.time() - since < self.settings.unknown_ttl_s:
            self._count("unknown")
            raise UnknownSchema(schema_id)
        task = self._inflight.get(schema_id)
        if task is None:
            task = loop.create_task(self._load(schema_id))
            self._inflight[schema_id] = task
            task.add_done_callback(lambda _t: self._inflight.pop(schema_id, None))
        # One lookup serves every waiter; a waiter cancelled leaves it to the others.
        return await asyncio.shield(task)

    async def _load(self, schema_id: int) -> Schema:
        try:  # not in the registry, or there but not parseable: unknown either way
            schema = await self._parse(schema_id, await self._get(f"/schemas/ids/{schema_id}"))
        except UnknownSchema:
            self._unknown.pop(schema_id, None)  # asked again after its ttl: the newest now
            self._unknown[schema_id] = asyncio.get_running_loop().time()
            if len(self._unknown) > self.settings.cache_size:
                self._unknown.pop(next(iter(self._unknown)))
            self._count("unknown")
            raise
        self._cache[schema_id] = schema
        if len(self._cache) > self.settings.cache_size:
            self._cache.popitem(last=False)
        self._count("fetched")
        return schema

    async def _parse(self, schema_id: int, body: dict[str, Any]) -> Schema:
        kind = str(body.get("schemaType") or "AVRO").upper()
        text = body.get("schema")
        if not isinstance(text, str):
            raise UnknownSchema(schema_id)
        if kind == "AVRO":
            named: dict[str, Any] = {}
            try:
                await self._references(body.get("references") or [], named)
                avro = fastavro.parse_schema(orjson.loads(text), named_schemas=named)
            except (fastavro.schema.SchemaParseException, fastavro.schema.UnknownType,
                    ValueError, TypeError, KeyError) as exc:  # fmt: skip
                log.warning("schema %d of the registry does not parse: %s", schema_id, exc)
                raise UnknownSchema(schema_id) from exc
            return Schema(schema_id, kind, avro=avro)
        if kind == "JSON":
            try:
                document = orjson.loads(text)
                cls = jsonschema.validators.validator_for(document, jsonschema.Draft7Validator)
                cls.check_schema(document)
                resources = await self._json_references(body.get("references") or [], document)
            except (orjson.JSONDecodeError, jsonschema.SchemaError, TypeError, KeyError,
                    referencing.exceptions.CannotDetermineSpecification) as exc:  # fmt: skip
                log.warning("schema %d of the registry does not parse: %s", schema_id, exc)
                raise UnknownSchema(schema_id) from exc
            registry: referencing.Registry[Any] = referencing.Registry().with_resources(resources)
            return Schema(schema_id, kind, validator=cls(document, registry=registry))
        return Schema(schema_id, kind)

    async def _referenced(
        self, refs: Any, referrer: Any, depth: int = 0, read: dict[str, Any] | None = None
    ) -> list[tuple[dict[str, Any], Any, Any]]:
        """The schemas `refs` (of the schema `referrer`) take from other subjects, theirs
        with them, depth first — a reference's own references before it: (the reference,
        its schema parsed, the referrer's). Each subject version is read once (`read`), so
        types shared by several (an address of a customer and of an order) cost one
        request, and its references are walked once."""
        if depth > _MAX_REFERENCE_DEPTH:
            raise UnknownSchema(f"references nested over {_MAX_REFERENCE_DEPTH} deep")
        if not isinstance(refs, list) or not all(isinstance(ref, dict) for ref in refs):
            raise UnknownSchema(f"references that are no list of objects: {str(refs)[:200]}")
        read = {} if read is None else read
        found: list[tuple[dict[str, Any], Any, Any]] = []
        for ref in refs:
            subject, version = quote(str(ref.get("subject")), safe=""), ref.get("version")
            path = f"/subjects/{subject}/versions/{quote(str(version), safe='')}"
            if path not in read:
                body = await self._get(path)
                read[path] = schema = orjson.loads(body["schema"])
                found += await self._referenced(body.get("references") or [], schema,
                                                 depth + 1, read)  # fmt: skip
            found.append((ref, read[path], referrer))
        return found

    async def _references(self, refs: Any, named: dict[str, Any]) -> None:
        """Avro named types that a schema takes from other subjects, parsed into `named`."""
        for _ref, schema, _referrer in await self._referenced(refs, None):
            fastavro.parse_schema(schema, named_schemas=named)

    async def _json_references(
        self, refs: Any, document: Any
    ) -> list[tuple[str, referencing.Resource[Any]]]:
        """The JSON schemas a JSON schema (`document`) takes from other subjects (Confluent's
        JSON Schema references), with their own: each under every URI a `$ref` may reach it
        by — the reference's name, that name against the referrer's `$id`, and its own."""
        found: list[tuple[str, referencing.Resource[Any]]] = []
        for ref, schema, referrer in await self._referenced(refs, document):
            resource = referencing.Resource.from_contents(
                schema, default_specification=referencing.jsonschema.DRAFT7
            )
            name, base = str(ref.get("name")), _base_of(referrer)
            uris = {name, urljoin(base, name) if base else name, resource.id() or name}
            found += [(uri, resource) for uri in sorted(uris)]
        return found

    async def _get(self, path: str) -> dict[str, Any]:
        """GET `path`: the JSON body; UnknownSchema on 404; otherwise tries until it
        gets an answer (an outage of the registry is waited out, never dead-lettered)."""
        wait = 0.2
        while True:
            try:
                session = self._session_now()
                async with session.get(self.url + path) as reply:
                    if reply.status == 200:
                        body = await reply.json(content_type=None)
                        if isinstance(body, dict):
                            return body
                        why = "an answer that is not a JSON object"
                    elif reply.status == 404:
                        raise UnknownSchema(path)
                    else:
                        why = f"HTTP {reply.status}: {(await reply.text())[:200]}"
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                why = f"{type(exc).__name__}: {exc}"
            self._count("unavailable")
            log.warning("schema registry %s%s: %s; trying again in %.1fs", self.url, path,
                        why, wait)  # fmt: skip
            await asyncio.sleep(wait)
            wait = min(wait * 2, self.settings.retry_max_s)

    async def latest(self, subject: str) -> tuple[str, dict[str, Any]]:
        """The type (AVRO, JSON, PROTOBUF) and the schema of `subject`'s latest version.
        Raises UnknownSchema when the subject has none."""
        found = await self._get(f"/subjects/{quote(subject, safe='')}/versions/latest")
        kind = str(found.get("schemaType") or "AVRO")
        try:
            schema = orjson.loads(str(found.get("schema")))
        except orjson.JSONDecodeError as exc:
            raise RegistryRefused(f"{subject}: its latest schema is no JSON: {exc}") from exc
        return kind, schema if isinstance(schema, dict) else {"type": schema}

    async def register(self, subject: str, schema: dict[str, Any], kind: str = "JSON") -> int:
        """The id of `schema` under `subject`, registered when it is new there. Raises
        RegistryRefused when the subject's compatibility rule refuses it (with what the
        registry said), aiohttp.ClientError or TimeoutError when the registry is away."""
        body = {"schema": orjson.dumps(schema).decode(), "schemaType": kind}
        session = self._session_now()
        base = f"{self.url}/compatibility/subjects/{quote(subject, safe='')}/versions/latest"
        async with session.post(base + "?verbose=true", json=body) as reply:
            if reply.status == 200:
                found = await reply.json(content_type=None)
                if isinstance(found, dict) and found.get("is_compatible") is False:
                    why = "; ".join(map(str, found.get("messages") or [])) or "incompatible"
                    raise RegistryRefused(f"{subject}: the registry's compatibility rule "
                                          f"refuses the new schema: {why[:500]}")  # fmt: skip
            elif reply.status != 404:  # 404: no version yet, nothing to be compatible with
                raise RegistryRefused(
                    f"{subject}: HTTP {reply.status}: {(await reply.text())[:200]}"
                )
        versions = f"{self.url}/subjects/{quote(subject, safe='')}/versions"
        async with session.post(versions, json=body) as reply:
            answer = await reply.json(content_type=None) if reply.status == 200 else None
            if not isinstance(answer, dict) or not isinstance(answer.get("id"), int):
                raise RegistryRefused(
                    f"{subject}: HTTP {reply.status}: {(await reply.text())[:200]}"
                )
            return int(answer["id"])

    async def check(self) -> None:
        """One request, no retry: the registry answers with these credentials. Raises
        aiohttp.ClientError, TimeoutError or RegistryRefused."""
        async with self._session_now().get(self.url + "/subjects") as reply:
            if reply.status != 200:
                raise RegistryRefused(f"HTTP {reply.status}: {(await reply.text())[:200]}")

    def _session_now(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            s = self.settings
            context: ssl.SSLContext | None = None
            if s.ca_file is not None:
                context = ssl.create_default_context(cafile=str(s.ca_file))
            auth = None
            if s.username is not None and s.password is not None:
                auth = aiohttp.BasicAuth(s.username, s.password.get_secret_value())
            self._session = aiohttp.ClientSession(
                auth=auth,
                timeout=aiohttp.ClientTimeout(total=s.timeout_s),
                connector=aiohttp.TCPConnector(ssl=context) if context else None,
                headers={"Accept": "application/vnd.schemaregistry.v1+json, application/json"},
            )
        return self._session

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.schema_lookups.labels(outcome).inc()

    async def close(self) -> None:
        for task in list(self._inflight.values()):
            task.cancel()
        if self._session is not None:
            await self._session.close()
            self._session = None


class RecordDecoder:
    """Bytes in the wire format to a JSON-ready document."""

    def __init__(self, client: RegistryClient) -> None:
        self.client = client

    async def decode(self, value: bytes) -> Any:
        if len(value) < HEADER_BYTES or value[0] != MAGIC:
            raise InvalidInput(
                "source record is not in the schema registry's wire format (a 0 byte and a "
                f"4-byte schema id first); it starts {value[:HEADER_BYTES]!r}",
                code="source_not_framed",
            )
        schema_id = int.from_bytes(value[1:HEADER_BYTES], "big")
        try:
            schema = await self.client.schema(schema_id)
        except UnknownSchema:
            raise InvalidInput(f"the schema registry has no schema {schema_id}",
                               code="source_schema_unknown") from None  # fmt: skip
        return decode_body(schema, value[HEADER_BYTES:])


def decode_body(schema: Schema, body: bytes) -> Any:
    """The body of a framed record read with its schema, JSON-ready; InvalidInput when
    it does not decode or (JSON Schema) does not conform."""
    if schema.kind == "AVRO" and schema.avro is not None:
        if schema.unbounded:
            AvroBounds(schema.avro).check(body, schema.id)
        stream = io.BytesIO(body)
        try:
            document = fastavro.schemaless_reader(stream, schema.avro, None)
        except Exception as exc:  # fastavro raises what the bytes lead it to
            why = f"{type(exc).__name__}: {exc}"
            raise InvalidInput(f"source record does not decode with Avro schema {schema.id}: "
                               f"{why}", code="source_undecodable") from None  # fmt: skip
        left = len(body) - stream.tell()
        if left:
            raise InvalidInput(f"source record has {left} bytes after its Avro body (schema "
                               f"{schema.id})", code="source_undecodable")  # fmt: skip
        return jsonable(shallow(document, source=True))
    if schema.kind == "JSON":
        try:
            document = record_json(body)
        except orjson.JSONDecodeError as exc:
            raise InvalidInput(f"source record's body is not JSON: {exc}",
                               code="source_undecodable") from None  # fmt: skip
        shallow(document, body, source=True)
        try:
            error = jsonschema.exceptions.best_match(schema.validator.iter_errors(document))
        except referencing.exceptions.Unresolvable as exc:  # a $ref to nowhere it knows
            raise InvalidInput(f"JSON schema {schema.id} has a $ref that resolves neither "
                               f"within it nor to one of its references: {exc}",
                               code="source_schema_unknown") from None  # fmt: skip
        if error is not None:
            where = "/" + "/".join(str(p) for p in error.absolute_path)
            raise InvalidInput(f"source record does not conform to JSON schema {schema.id} "
                               f"at {where}: {error.message}",
                               code="source_schema_mismatch")  # fmt: skip
        return document
    raise InvalidInput(f"source record's schema {schema.id} is {schema.kind}; only AVRO and "
                       "JSON records are decoded", code="source_schema_type")  # fmt: skip


def _base_of(schema: Any) -> str | None:
    """A JSON schema's own `$id`, against which its relative `$ref`s resolve."""
    found = schema.get("$id") if isinstance(schema, dict) else None
    return found if isinstance(found, str) and found else None


# Array items that take no bytes (nulls, empty records, fixed of size 0) an Avro record may
# hold beyond one per byte of its body.
ITEMS_OF_NO_BYTES = 65_536
_PRIMITIVE_BYTES = {"null": 0, "boolean": 1, "float": 4, "double": 8}


class _Unreadable(Exception):
    """The body ends early or says something no Avro writer writes."""


class AvroBounds:
    """Whether an Avro record's body stays within what a worker can decode, read before
    fastavro reads it, for the schemas that need it. Two shapes let a few bytes decode
    into what no process survives: a named type inside itself (a list, a tree), whose
    values nest as deep as their bytes go — fastavro reads them by recursion in C, and
    a 10 KB linked list overflows the stack: the process dies, and every restart dies
    again on the same record —; and an array of items that take no bytes, whose 6-byte
    body can say two billion nulls (16 GB of list). Their bodies are walked first,
    building nothing, within `MAX_DEPTH` levels (the one limit of every record's JSON)
    and `ITEMS_OF_NO_BYTES` more items than bytes; every other schema's values are
    bounded by their bytes and go to fastavro at once.

    Hand-written: fastavro has no limit of depth or size (its pure-Python reader
    recurses as deep and lists as long)."""

    def __init__(self, schema: Any) -> None:
        self.schema = schema
        self.named: dict[str, Any] = (
            schema.get("__named_schemas", {}) if isinstance(schema, dict) else {}
        )

    # -- the schema ------------------------------------------------------------------

    def unbounded(self) -> bool:
        """Does the schema hold a named type inside itself, or an array of empty items?"""
        return self._unbounded(self.schema, set(), set())

    def _unbounded(self, t: Any, inside: set[str], bounded: set[str]) -> bool:
        if isinstance(t, str):
            if t in inside:
                return True  # a named type inside itself
            return (
                t not in bounded
                and t in self.named
                and self._unbounded(self.named[t], inside, bounded)
            )
        if isinstance(t, list):
            return any(self._unbounded(branch, inside, bounded) for branch in t)
        kind = t.get("type") if isinstance(t, dict) else None
        if isinstance(kind, dict | list):
            return self._unbounded(kind, inside, bounded)
        if kind in ("record", "error"):
            return self._record_unbounded(t, inside, bounded)
        if kind == "array":
            return self._empty(t["items"], set()) or self._unbounded(t["items"], inside, bounded)
        if kind == "map":
            return self._unbounded(t["values"], inside, bounded)
        return False

    def _record_unbounded(self, t: dict[str, Any], inside: set[str], bounded: set[str]) -> bool:
        name = str(t.get("name"))
        if name in inside:
            return True
        if name in bounded:
            return False
        inside.add(name)
        found = any(self._unbounded(f["type"], inside, bounded) for f in t["fields"])
        inside.discard(name)
        if not found:
            bounded.add(name)
        return found

    def _empty(self, t: Any, seen: set[str]) -> bool:
        """Does a value of `t` take no bytes?"""
        if isinstance(t, str):
            if t == "null":
                return True
            if t in seen or t not in self.named:
                return False
            return self._empty(self.named[t], seen | {t})
        if not isinstance(t, dict):
            return False  # a union's branch takes a byte at least
        kind = t.get("type")
        if isinstance(kind, dict | list):
            return self._empty(kind, seen)
        if kind == "fixed":
            return t.get("size") == 0
        if kind in ("record", "error"):
            inner = seen | {str(t.get("name"))}
            return all(self._empty(f["type"], inner) for f in t["fields"])
        return kind == "null"

    # -- a body ----------------------------------------------------------------------

    def check(self, body: bytes, schema_id: int) -> None:
        """InvalidInput when `body` nests over `MAX_DEPTH` levels or holds over
        `ITEMS_OF_NO_BYTES` items more than its bytes; what does not decode is left to
        fastavro to say."""
        self._body, self._at = body, 0
        self._items_left = len(body) + ITEMS_OF_NO_BYTES
        try:
            self._value(self.schema, 0)
        except _Unreadable:
            return  # fastavro says what is wrong with it
        except _TooDeep:
            raise InvalidInput(f"source record nests objects and arrays over {MAX_DEPTH} "
                               f"levels deep (Avro schema {schema_id})",
                               code="source_too_deep") from None  # fmt: skip
        except _TooMany:
            raise InvalidInput(f"source record holds over {len(body) + ITEMS_OF_NO_BYTES} "
                               f"array items in {len(body)} bytes (Avro schema {schema_id})",
                               code="source_undecodable") from None  # fmt: skip

    def _value(self, t: Any, depth: int) -> None:
        composite = self._resolved(t)
        if composite is None:
            return  # a primitive, read
        kind = composite["type"]
        if kind == "enum":
            self._long()
        elif kind == "fixed":
            self._skip(int(composite["size"]))
        elif depth >= MAX_DEPTH:
            raise _TooDeep
        elif kind == "array":
            self._blocks(composite["items"], depth + 1, keyed=False)
        elif kind == "map":
            self._blocks(composite["values"], depth + 1, keyed=True)
        else:
            for f in composite["fields"]:
                self._value(f["type"], depth + 1)

    def _resolved(self, t: Any) -> dict[str, Any] | None:
        """The record, enum, fixed, array or map a value of `t` is — names, union
        branches and logical types resolved in a loop, so that a level of nesting costs
        a frame or two of the interpreter's stack, not five —; None: a primitive, read."""
        while not isinstance(t, dict) or t.get("type") not in _COMPOSITE:
            if isinstance(t, str):
                if t not in self.named:
                    self._primitive(t)
                    return None
                t = self.named[t]
            elif isinstance(t, list):
                branch = self._long()
                if not 0 <= branch < len(t):
                    raise _Unreadable(branch)
                t = t[branch]
            elif isinstance(t, dict):
                t = t.get("type")  # a primitive with its logical type, or a type wrapped
            else:
                raise _Unreadable(t)
        return t

    def _primitive(self, t: str) -> None:
        if t in _PRIMITIVE_BYTES:
            self._skip(_PRIMITIVE_BYTES[t])
        elif t in ("int", "long"):
            self._long()
        elif t in ("bytes", "string"):
            self._skip(self._long())
        else:
            raise _Unreadable(t)

    def _blocks(self, t: Any, depth: int, *, keyed: bool) -> None:
        while count := self._long():
            if count < 0:
                count = -count
                self._long()  # the block's size in bytes
            self._items_left -= count
            if self._items_left < 0:
                raise _TooMany
            for _ in range(count):
                if keyed:
                    self._skip(self._long())
                self._value(t, depth)

    def _long(self) -> int:
        body, at, shift, n = self._body, self._at, 0, 0
        while True:
            if at >= len(body) or shift > 63:
                raise _Unreadable("varint")
            byte = body[at]
            at += 1
            n |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                break
        self._at = at
        return (n >> 1) ^ -(n & 1)

    def _skip(self, n: int) -> None:
        if n < 0 or self._at + n > len(self._body):
            raise _Unreadable("length")
        self._at += n


_COMPOSITE = frozenset({"record", "error", "enum", "fixed", "array", "map"})


class _TooDeep(Exception):
    pass


class _TooMany(Exception):
    pass


def jsonable(value: Any) -> Any:
    """A decoded Avro value with only JSON types: bytes as base64, decimals as exact
    strings, dates and times in ISO 8601, UUIDs as strings."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, bytes | bytearray):
        return base64.b64encode(value).decode()
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


__all__ = ["RecordDecoder", "RegistryClient", "RegistryRefused", "Schema", "UnknownSchema",
           "decode_body", "jsonable"]  # fmt: skip
