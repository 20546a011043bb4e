"""Records in the schema registry's wire format: Avro and JSON Schema bodies decoded to
JSON-ready documents; every way a record can be bad is invalid input with its reason;
the registry's outages are waited out (never dead-lettered), lookups are shared, the
cache is bounded, and a lookup cancelled mid-outage ends at once.

The registry here is a small aiohttp server that can fail on command (fault
injection); tests/integration/test_sources.py runs against a real registry server."""

from __future__ import annotations

import asyncio
import datetime as dt
import io
import subprocess
import sys
import uuid
from decimal import Decimal
from typing import Any

import fastavro
import orjson
import pytest

from streams.errors import InvalidInput
from streams.observability.metrics import Metrics
from streams.schema_registry import (
    ITEMS_OF_NO_BYTES,
    RecordDecoder,
    RegistryClient,
    Schema,
    UnknownSchema,
    decode_body,
)
from streams.settings import SchemaRegistrySettings
from tests.fakes import FakeRegistry

REVIEW = {
    "type": "record",
    "name": "Review",
    "namespace": "shop",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "body", "type": ["null", "string"], "default": None},
        {"name": "price", "type": {"type": "bytes", "logicalType": "decimal",
                                   "precision": 8, "scale": 2}},
        {"name": "at", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {"name": "ref", "type": {"type": "string", "logicalType": "uuid"}},
        {"name": "blob", "type": "bytes"},
    ],
}  # fmt: skip


def framed(schema_id: int, body: bytes) -> bytes:
    return b"\x00" + schema_id.to_bytes(4, "big") + body


def avro_body(schema: dict[str, Any], record: dict[str, Any]) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(schema), record)
    return out.getvalue()


def review(**overrides: Any) -> dict[str, Any]:
    record = {"id": 7, "body": "The zip broke.", "price": Decimal("19.99"),
              "at": dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC),
              "ref": uuid.UUID("12345678-1234-5678-1234-567812345678"), "blob": b"\x01\x02"}  # fmt: skip
    return {**record, **overrides}


def client_for(server: FakeRegistry, metrics: Metrics | None = None, **settings: Any
               ) -> RegistryClient:  # fmt: skip
    base: dict[str, Any] = {"url": server.url, "retry_max_s": 0.05}
    return RegistryClient(SchemaRegistrySettings(**{**base, **settings}), metrics)


def avro_schema(schema_id: int, schema: dict[str, Any]) -> Schema:
    return Schema(schema_id, "AVRO", avro=fastavro.parse_schema(schema))


def test_an_avro_body_decodes_to_json_ready_values() -> None:
    document = decode_body(avro_schema(1, REVIEW), avro_body(REVIEW, review()))
    assert document == {"id": 7, "body": "The zip broke.", "price": "19.99",
                        "at": "2026-11-30T12:00:00+00:00",
                        "ref": "12345678-1234-5678-1234-567812345678", "blob": "AQI="}  # fmt: skip
    orjson.dumps(document)  # results stay JSON: every value serialises


def test_a_body_nested_deeper_than_a_task_can_hold_is_invalid_input() -> None:
    """A recursive Avro schema (a thread of replies) or an open JSON Schema lets a record
    nest as deep as its bytes go: past 128 levels it could not be written back."""
    import jsonschema

    thread = {"type": "record", "name": "Reply", "fields": [
        {"name": "text", "type": "string"},
        {"name": "reply", "type": ["null", "Reply"], "default": None}]}  # fmt: skip

    def replies(n: int) -> dict[str, Any]:
        node: dict[str, Any] = {"text": "last", "reply": None}
        for i in range(n - 1):
            node = {"text": f"reply {i}", "reply": node}
        return node

    assert (
        decode_body(avro_schema(8, thread), avro_body(thread, replies(128)))["text"] == "reply 126"
    )
    open_schema = Schema(9, "JSON", validator=jsonschema.Draft7Validator({"type": "object"}))
    for schema, body in [(avro_schema(8, thread), avro_body(thread, replies(300))),
                         (open_schema, b'{"a": ' + b"[" * 300 + b"]" * 300 + b"}")]:  # fmt: skip
        with pytest.raises(InvalidInput) as caught:
            decode_body(schema, body)
        assert caught.value.code == "source_too_deep"


def test_a_recursive_avro_record_nested_past_what_fastavro_survives_is_a_dead_letter() -> None:
    """fastavro reads a named type inside itself by recursion in C: a linked list 10,000
    deep (20 KB) overflowed its stack and killed the process, and every restart died
    on the same record. Run in a process of its own, so that on a regression this test
    fails instead of taking the test run down with it."""
    script = """
import fastavro, io
from streams.errors import InvalidInput
from streams.schema_registry import Schema, decode_body
thread = {"type": "record", "name": "Reply", "fields": [
    {"name": "text", "type": "string"}, {"name": "reply", "type": ["null", "Reply"]}]}
body = b"\\x00\\x02" * 10_000 + b"\\x00\\x00"  # 10,000 empty texts, each with a reply
try:
    decode_body(Schema(8, "AVRO", avro=fastavro.parse_schema(thread)), body)
except InvalidInput as exc:
    print(exc.code)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "source_too_deep"


def _zigzag(n: int) -> bytes:
    n, out = (n << 1) ^ (n >> 63), bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


@pytest.mark.parametrize(
    "items",
    [
        "null",
        {"type": "record", "name": "Nothing", "fields": []},
        {"type": "fixed", "name": "Zero", "size": 0},
    ],
)
def test_an_avro_array_of_items_that_take_no_bytes_is_bounded(items: Any) -> None:
    """A 5-byte body may say three million nulls (two billion in 6: 16 GB of list): past
    `ITEMS_OF_NO_BYTES` more items than its bytes, the record is a dead letter, in a
    block of either sign; arrays of that many are still read."""
    schema = avro_schema(4, {"type": "array", "items": items})
    assert schema.unbounded
    for body in (_zigzag(3_000_000) + _zigzag(0), _zigzag(-(2**31)) + _zigzag(0) + _zigzag(0)):
        with pytest.raises(InvalidInput) as caught:
            decode_body(schema, body)
        assert caught.value.code == "source_undecodable"
        assert "array items" in caught.value.message
    assert len(decode_body(schema, _zigzag(ITEMS_OF_NO_BYTES) + _zigzag(0))) == ITEMS_OF_NO_BYTES


def test_only_schemas_whose_values_may_outgrow_their_bytes_are_walked_first() -> None:
    assert not avro_schema(1, REVIEW).unbounded
    assert not avro_schema(2, {"type": "array", "items": ["null", "int"]}).unbounded
    assert not avro_schema(3, {"type": "array", "items": {"type": "fixed", "name": "B",
                                                          "size": 1}}).unbounded  # fmt: skip
    tree = {"type": "record", "name": "Node", "fields": [
        {"name": "kids", "type": {"type": "map", "values": "Node"}}]}  # fmt: skip
    assert avro_schema(5, tree).unbounded


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (avro_body(REVIEW, review())[:-3], "source_undecodable"),  # truncated
        (avro_body(REVIEW, review()) + b"\x00\x07", "source_undecodable"),  # bytes left over
        (b"\xff" * 3, "source_undecodable"),  # not Avro at all
    ],
)
def test_a_body_that_does_not_decode_is_invalid_input(body: bytes, code: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        decode_body(avro_schema(3, REVIEW), body)
    assert caught.value.code == code
    assert "schema 3" in caught.value.message


def test_json_schema_bodies_are_validated_and_protobuf_is_refused() -> None:
    import jsonschema

    comment = {"type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}}
    schema = Schema(5, "JSON", validator=jsonschema.Draft7Validator(comment))
    assert decode_body(schema, b'{"text": "ok"}') == {"text": "ok"}
    with pytest.raises(InvalidInput) as caught:
        decode_body(schema, b'{"text": 42}')
    assert caught.value.code == "source_schema_mismatch"
    assert "/text" in caught.value.message
    with pytest.raises(InvalidInput) as caught:
        decode_body(schema, b"{not json")
    assert caught.value.code == "source_undecodable"
    # An integer beyond 64 bits: refused, not read as a double (its value would change).
    with pytest.raises(InvalidInput) as caught:
        decode_body(schema, b'{"text": "ok", "order": 123456789012345678901234}')
    assert caught.value.code == "source_undecodable" and "beyond 64 bits" in caught.value.message
    with pytest.raises(InvalidInput) as caught:
        decode_body(Schema(6, "PROTOBUF"), b"\x00\x08\x01")
    assert caught.value.code == "source_schema_type"


async def test_records_are_read_with_their_schema_and_bad_ids_are_invalid_input(
    fake_registry: FakeRegistry,
) -> None:
    fake_registry.schemas[11] = {
        "schema": orjson.dumps(REVIEW).decode()
    }  # schemaType omitted: AVRO
    metrics = Metrics()
    decoder = RecordDecoder(client_for(fake_registry, metrics, unknown_ttl_s=60))
    try:
        body = avro_body(REVIEW, review(id=9))
        assert (await decoder.decode(framed(11, body)))["id"] == 9
        assert (await decoder.decode(framed(11, body)))["id"] == 9  # from the cache
        for _ in range(3):  # an unknown id is asked once, then remembered
            with pytest.raises(InvalidInput) as caught:
                await decoder.decode(framed(404, body))
            assert caught.value.code == "source_schema_unknown"
        with pytest.raises(InvalidInput) as caught:
            await decoder.decode(b'{"id": 9}')  # plain JSON, not framed
        assert caught.value.code == "source_not_framed"
    finally:
        await decoder.client.close()
    assert fake_registry.requests == ["/schemas/ids/11", "/schemas/ids/404"]
    count = metrics.schema_lookups.labels
    assert count("cached")._value.get() == 1
    assert count("fetched")._value.get() == 1
    assert count("unknown")._value.get() == 3


async def test_an_outage_is_waited_out_and_lookups_of_one_id_share_a_request(
    fake_registry: FakeRegistry,
) -> None:
    fake_registry.schemas[12] = {"schema": orjson.dumps(REVIEW).decode(), "schemaType": "AVRO"}
    fake_registry.fail_next = 3  # the registry answers 503 three times, then recovers
    metrics = Metrics()
    decoder = RecordDecoder(client_for(fake_registry, metrics))
    body = framed(12, avro_body(REVIEW, review()))
    try:
        documents = await asyncio.gather(*(decoder.decode(body) for _ in range(20)))
    finally:
        await decoder.client.close()
    assert all(d["id"] == 7 for d in documents)  # nothing dead-lettered for the outage
    assert fake_registry.requests == ["/schemas/ids/12"] * 4  # 3 failures + 1 answer, shared by 20
    assert metrics.schema_lookups.labels("unavailable")._value.get() == 3


async def test_a_lookup_cancelled_while_the_registry_hangs_ends_at_once(
    fake_registry: FakeRegistry,
) -> None:
    fake_registry.schemas[13] = {"schema": orjson.dumps(REVIEW).decode()}
    fake_registry.hold.clear()  # every request hangs
    client = client_for(fake_registry, timeout_s=30)
    waiter = asyncio.ensure_future(client.schema(13))
    await asyncio.sleep(0.2)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(waiter, 1.0)
    await asyncio.wait_for(client.close(), 1.0)  # the shared lookup is cancelled too
    assert not client._inflight


async def test_the_cache_is_bounded_and_references_are_resolved(
    fake_registry: FakeRegistry,
) -> None:
    product = {"type": "record", "name": "Product", "namespace": "shop",
               "fields": [{"name": "name", "type": "string"}]}  # fmt: skip
    order = {"type": "record", "name": "Order", "namespace": "shop",
             "fields": [{"name": "product", "type": "shop.Product"}]}  # fmt: skip
    fake_registry.subjects[("product-value", "1")] = {"schema": orjson.dumps(product).decode()}
    for schema_id in (21, 22, 23):
        fake_registry.schemas[schema_id] = {
            "schema": orjson.dumps(order).decode(),
            "references": [{"name": "shop.Product", "subject": "product-value", "version": 1}],
        }
    client = client_for(fake_registry, cache_size=2)
    decoder = RecordDecoder(client)
    try:
        for schema_id in (21, 22, 23):
            body = avro_body({**order, "fields": [{"name": "product", "type": product}]},
                             {"product": {"name": "Bag"}})  # fmt: skip
            assert await decoder.decode(framed(schema_id, body)) == {"product": {"name": "Bag"}}
        assert len(client._cache) == 2
        assert list(client._cache) == [22, 23]  # least recently used left
    finally:
        await client.close()


async def test_a_schema_that_does_not_parse_is_an_unknown_schema(
    fake_registry: FakeRegistry,
) -> None:
    fake_registry.schemas[31] = {"schema": '{"type": "record", "name": "X", "fields": [{"nam'}
    client = client_for(fake_registry)
    try:
        with pytest.raises(UnknownSchema):
            await client.schema(31)
    finally:
        await client.close()


@pytest.mark.parametrize(
    "references",
    [{"name": "shop.Product", "subject": "product-value", "version": 1}, ["product-value"], 7],
    ids=["an object", "names", "a number"],
)
async def test_references_that_are_no_list_of_objects_make_an_unknown_schema(
    fake_registry: FakeRegistry, references: Any
) -> None:
    """What the registry holds is another team's: a schema whose references are not the
    list of objects Confluent's API gives is invalid input with its reason, not a bug
    of the worker (it was an AttributeError, each record an internal_error)."""
    fake_registry.schemas[41] = {"schema": orjson.dumps(REVIEW).decode(),
                                 "references": references}  # fmt: skip
    decoder = RecordDecoder(client_for(fake_registry))
    try:
        with pytest.raises(InvalidInput) as caught:
            await decoder.decode(framed(41, avro_body(REVIEW, review())))
        assert caught.value.code == "source_schema_unknown"
    finally:
        await decoder.client.close()


async def test_a_reference_to_a_subject_with_a_slash_in_its_name_is_resolved(
    fake_registry: FakeRegistry,
) -> None:
    """A subject's name is a path segment of the registry's API and may hold any
    character: quoted, a subject named with a slash is found, not asked for at a path
    that does not exist (a 404: every record of the schema a dead letter)."""
    product = {"type": "record", "name": "Product", "namespace": "shop",
               "fields": [{"name": "name", "type": "string"}]}  # fmt: skip
    order = {"type": "record", "name": "Order", "namespace": "shop",
             "fields": [{"name": "product", "type": "shop.Product"}]}  # fmt: skip
    fake_registry.subjects[("team/product-value", "1")] = {"schema": orjson.dumps(product).decode()}
    fake_registry.schemas[42] = {
        "schema": orjson.dumps(order).decode(),
        "references": [{"name": "shop.Product", "subject": "team/product-value", "version": 1}],
    }
    decoder = RecordDecoder(client_for(fake_registry))
    body = avro_body({**order, "fields": [{"name": "product", "type": product}]},
                     {"product": {"name": "Bag"}})  # fmt: skip
    try:
        assert await decoder.decode(framed(42, body)) == {"product": {"name": "Bag"}}
    finally:
        await decoder.client.close()


async def test_an_unknown_id_asked_again_is_the_last_one_the_bound_drops(
    fake_registry: FakeRegistry,
) -> None:
    """The unknown ids are remembered in a bounded map, the oldest dropped first: an id
    asked again once its ttl ran out (still unknown) is the newest, not dropped next
    while it is the one records are coming with."""
    client = client_for(fake_registry, cache_size=2, unknown_ttl_s=0)
    try:
        for schema_id in (51, 52, 51):  # 51 asked again after its ttl
            with pytest.raises(UnknownSchema):
                await client.schema(schema_id)
        with pytest.raises(UnknownSchema):
            await client.schema(53)  # over the bound: the oldest goes
        assert list(client._unknown) == [51, 53]
    finally:
        await client.close()


async def test_a_json_schemas_references_to_other_subjects_are_resolved(
    fake_registry: FakeRegistry,
) -> None:
    """Confluent's JSON Schema references: `$ref: customer.json` names a schema registered
    under another subject. It was resolved nowhere: validating any record raised the
    reference error, each record an `internal_error` dead letter."""
    address = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}
    customer = {
        "type": "object",
        "required": ["name"],
        "properties": {"name": {"type": "string"}, "address": {"$ref": "address.json"}},
    }
    review = {"type": "object", "required": ["text", "by"],
              "properties": {"text": {"type": "string"}, "by": {"$ref": "customer.json"}}}  # fmt: skip
    fake_registry.subjects[("address", "1")] = {"schema": orjson.dumps(address).decode()}
    fake_registry.subjects[("customer", "2")] = {
        "schema": orjson.dumps(customer).decode(), "schemaType": "JSON",
        "references": [{"name": "address.json", "subject": "address", "version": 1}],
    }  # fmt: skip
    fake_registry.schemas[41] = {
        "schemaType": "JSON", "schema": orjson.dumps(review).decode(),
        "references": [{"name": "customer.json", "subject": "customer", "version": 2}],
    }  # fmt: skip
    decoder = RecordDecoder(client_for(fake_registry))
    try:
        good = {"text": "ok", "by": {"name": "Ann", "address": {"city": "Oslo"}}}
        assert await decoder.decode(framed(41, orjson.dumps(good))) == good
        bad = {"text": "ok", "by": {"name": "Ann", "address": {"city": 7}}}
        with pytest.raises(InvalidInput) as caught:
            await decoder.decode(framed(41, orjson.dumps(bad)))
        assert caught.value.code == "source_schema_mismatch"
        assert "/by/address/city" in caught.value.message
    finally:
        await decoder.client.close()


def test_a_json_schemas_ref_to_nowhere_is_said_for_each_record() -> None:
    import jsonschema

    orphan = {"type": "object", "properties": {"by": {"$ref": "customer.json"}}}
    schema = Schema(6, "JSON", validator=jsonschema.Draft7Validator(orphan))
    with pytest.raises(InvalidInput) as caught:
        decode_body(schema, b'{"by": {"name": "Ann"}}')
    assert caught.value.code == "source_schema_unknown"
    assert "customer.json" in caught.value.message and "schema 6" in caught.value.message


async def test_a_reference_is_found_by_its_name_against_the_referrers_id(
    fake_registry: FakeRegistry,
) -> None:
    """Confluent's own example: the referrer has an `$id`, so its `$ref: ref.json` reads as
    `http://example.com/ref.json` — the referenced schema's `$id`, or the reference's name
    against the referrer's."""
    for with_id in (True, False):
        ref = {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}
        if with_id:
            ref["$id"] = "http://example.com/ref.json"
        root = {"$id": "http://example.com/referrer.json", "type": "object",
                "properties": {"Ref": {"$ref": "ref.json"}}}  # fmt: skip
        fake_registry.subjects[("reference", "1")] = {"schema": orjson.dumps(ref).decode()}
        fake_registry.schemas[50 + with_id] = {
            "schemaType": "JSON", "schema": orjson.dumps(root).decode(),
            "references": [{"name": "ref.json", "subject": "reference", "version": 1}],
        }  # fmt: skip
        decoder = RecordDecoder(client_for(fake_registry))
        try:
            assert await decoder.decode(framed(50 + with_id, b'{"Ref": {"n": 1}}')) == {
                "Ref": {"n": 1}}  # fmt: skip
            with pytest.raises(InvalidInput) as caught:
                await decoder.decode(framed(50 + with_id, b'{"Ref": {"n": "one"}}'))
            assert caught.value.code == "source_schema_mismatch", caught.value.message
        finally:
            await decoder.client.close()


async def test_a_type_several_references_share_is_read_once(fake_registry: FakeRegistry) -> None:
    """An address of a customer and of a shipment, both of an order: each subject version
    is asked for once (a diamond at each of 16 levels was 65,536 requests)."""
    address = {"type": "record", "name": "Address", "namespace": "shop",
               "fields": [{"name": "city", "type": "string"}]}  # fmt: skip
    on_address = [{"name": "shop.Address", "subject": "address", "version": 1}]
    fake_registry.subjects[("address", "1")] = {"schema": orjson.dumps(address).decode()}
    for name in ("Customer", "Shipment"):
        record = {"type": "record", "name": name, "namespace": "shop",
                  "fields": [{"name": "at", "type": "shop.Address"}]}  # fmt: skip
        fake_registry.subjects[(name.lower(), "1")] = {
            "schema": orjson.dumps(record).decode(),
            "references": on_address,
        }
    order = {"type": "record", "name": "Order", "namespace": "shop",
             "fields": [{"name": "by", "type": "shop.Customer"},
                        {"name": "to", "type": "shop.Shipment"}]}  # fmt: skip
    fake_registry.schemas[61] = {"schema": orjson.dumps(order).decode(), "references": [
        {"name": "shop.Customer", "subject": "customer", "version": 1},
        {"name": "shop.Shipment", "subject": "shipment", "version": 1}]}  # fmt: skip
    decoder = RecordDecoder(client_for(fake_registry))
    try:
        whole = {**order, "fields": [
            {"name": "by", "type": {"type": "record", "name": "Customer", "fields": [
                {"name": "at", "type": address}]}},
            {"name": "to", "type": {"type": "record", "name": "Shipment", "fields": [
                {"name": "at", "type": "shop.Address"}]}}]}  # fmt: skip
        value = {"by": {"at": {"city": "Oslo"}}, "to": {"at": {"city": "Bergen"}}}
        assert await decoder.decode(framed(61, avro_body(whole, value))) == value
        assert fake_registry.requests.count("/subjects/address/versions/1") == 1
    finally:
        await decoder.client.close()
