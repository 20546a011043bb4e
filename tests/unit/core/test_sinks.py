"""A pipeline's sink records (`core.sinks`): its result in the shape and under the key
its users read, with its provenance; a copy of its dead letters; sized to the sink's
topic like every record the worker writes."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from jsonschema import Draft202012Validator
from pydantic import ValidationError

from streams.contract.headers import RESULT_KEY_HEADER, SOURCE_OF_HEADER, TASK_ID_HEADER
from streams.contract.records import EraseRequest, Source, Task, ValueLimits
from streams.core.avro_schema import avro_schema
from streams.core.sinks import (
    dead_letter_record,
    erased,
    framing,
    registered_schema,
    result_record,
    value_schema,
)
from streams.errors import ConfigError
from streams.pipelines.registry import PipelineRegistry
from streams.pipelines.sinks import SinkSpec
from tests.conftest import MakeProcessor
from tests.fakes import FakeLLM, answer

ROOT = Path(__file__).resolve().parents[3]
GOOD = {"sentiment": "negative", "confidence": 0.9, "topics": ["delivery"], "issues": [],
        "summary": "late", "language": "en"}  # fmt: skip
RESULT = {"task_id": "r-1", "result_key": "rk-1", "pipeline": "reviews", "prompt_version": "v1",
          "model": "m", "output": GOOD, "cost_usd": 0.0012, "cached": False,
          "processed_at": "2026-12-02T03:00:00.000Z", "usage": {}}  # fmt: skip
REVIEW = {"review_id": 7, "body": "Late again.", "stars": 1}


def _task(**kept: Any) -> Task:
    source_record = {"topic": "shop.reviews", "partition": 2, "offset": 41, "key": "rev-7",
                     "value": REVIEW, **kept}  # fmt: skip
    return Task.model_validate({"task_id": "r-1", "pipeline": "reviews",
                                "input": {"text": "Late again."},
                                "source_record": source_record})  # fmt: skip


def test_enriched_is_the_source_records_value_with_the_answer_and_its_provenance() -> None:
    sink = result_record(SinkSpec(topic="out", key="source_key"), _task(), RESULT)
    value = orjson.loads(sink.value)
    assert {k: value[k] for k in REVIEW} == REVIEW  # the source record as it was
    assert value["llm"]["output"] == GOOD
    assert value["llm"]["prompt_version"] == "v1" and value["llm"]["result_key"] == "rk-1"
    assert value["llm"]["cost_usd"] == 0.0012 and value["llm"]["model"] == "m"
    assert (sink.topic, sink.key) == ("out", b"rev-7")  # keyed as the source was
    headers = dict(sink.headers)
    assert headers[RESULT_KEY_HEADER] == b"rk-1" and headers[TASK_ID_HEADER] == b"r-1"
    assert headers[SOURCE_OF_HEADER] == b"shop.reviews/2/41"


def test_enriched_fields_by_pointer_put_the_answer_beside_the_record() -> None:
    spec = SinkSpec(topic="out", field="analysis",
                    fields={"sentiment": "/sentiment", "first_topic": "/topics/0",
                            "absent": "/no/such"})  # fmt: skip
    value = orjson.loads(result_record(spec, _task(), RESULT).value)
    assert (value["sentiment"], value["first_topic"], value["absent"]) == (
        "negative", "delivery", None)  # fmt: skip
    assert "output" not in value["analysis"] and value["analysis"]["result_key"] == "rk-1"


def test_a_task_published_to_llm_tasks_is_enriched_from_its_input() -> None:
    task = Task.model_validate({"task_id": "t-9", "pipeline": "reviews",
                                "input": {"text": "Fine."}})  # fmt: skip
    sink = result_record(SinkSpec(topic="out", key="source_key"), task, RESULT)
    value = orjson.loads(sink.value)
    assert value["text"] == "Fine." and value["llm"]["output"] == GOOD
    assert sink.key == b"t-9"  # no source record: its task id
    assert SOURCE_OF_HEADER not in dict(sink.headers)


@pytest.mark.parametrize(("shape", "key", "value", "key_bytes"), [
    ("envelope", "result_key", RESULT, b"rk-1"),
    ("output", "task_id", GOOD, b"r-1"),
])  # fmt: skip
def test_the_envelope_and_the_answer_alone(
    shape: str, key: str, value: dict[str, Any], key_bytes: bytes
) -> None:
    sink = result_record(SinkSpec(topic="out", shape=shape, key=key), _task(), RESULT)  # type: ignore[arg-type]
    assert orjson.loads(sink.value) == value and sink.key == key_bytes


def test_a_structured_source_key_is_its_canonical_json_and_headers_carry_by_name() -> None:
    task = _task(key={"shop": "s1", "id": 7}, headers={"tenant": "acme"})
    sink = result_record(SinkSpec(topic="out", key="source_key", headers=["tenant", "none"]),
                         task, RESULT)  # fmt: skip
    assert sink.key == b'{"id":7,"shop":"s1"}'
    assert dict(sink.headers)["tenant"] == b"acme" and "none" not in dict(sink.headers)


def test_a_source_key_that_is_not_utf8_keys_its_sink_records_and_erasure_as_read() -> None:
    raw = (255).to_bytes(8, "big")  # Java's LongSerializer
    text = "base64:" + base64.b64encode(raw).decode()
    task = _task(key=text, key_base64=base64.b64encode(raw).decode())
    spec = SinkSpec(topic="out", key="source_key")
    assert result_record(spec, task, RESULT).key == raw
    assert erased(spec, "r-1", text, [], base64.b64encode(raw).decode()) == [("out", raw)]
    assert erased(spec, "r-1", "rev-7", []) == [("out", b"rev-7")]  # a text key as ever
    request = EraseRequest(task_id="r-1", pipeline="reviews", source_key=text,
                           source_key_base64=base64.b64encode(raw).decode())  # fmt: skip
    assert EraseRequest.model_validate_json(request.wire()) == request
    # Written only when set: a worker of an older version forbids fields it does not know.
    assert b"source_key_base64" not in EraseRequest(task_id="r-1", pipeline="reviews").wire()
    with pytest.raises(ValidationError, match="not base64"):
        _task(key=text, key_base64="no base64!")


def test_a_header_that_is_not_utf8_is_carried_over_as_read() -> None:
    """Confluent's schema ids in headers are 16 bytes of a GUID: read as text with
    replacement characters, they went to the sink as other bytes."""
    guid = bytes(range(0x80, 0x90))
    task = _task(headers={"__value_schema_id": guid.decode(errors="replace"), "tenant": "acme"},
                 headers_base64={"__value_schema_id": base64.b64encode(guid).decode()})  # fmt: skip
    spec = SinkSpec(topic="out", headers=["__value_schema_id", "tenant"])
    headers = dict(result_record(spec, task, RESULT).headers)
    assert headers["__value_schema_id"] == guid and headers["tenant"] == b"acme"


def test_a_dead_letter_is_copied_only_to_a_topic_of_the_pipelines_own() -> None:
    assert dead_letter_record(SinkSpec(topic="out"), "r-1", b"{}") is None
    copy = dead_letter_record(SinkSpec(topic="out", dead_letters="out.dlq"), "r-1", b"{}")
    assert copy is not None and (copy.topic, copy.key, copy.value) == ("out.dlq", b"r-1", b"{}")


@pytest.mark.parametrize("spec", [
    {"topic": "out", "shape": "output", "field": "x"},  # field is the enriched shape's
    {"topic": "out", "fields": {"s": "sentiment"}},  # not a pointer
    {"topic": "out", "fields": {"llm": "/sentiment"}},  # over the provenance's field
    {"topic": "out", "dead_letters": "out"},
    {"topic": "out", "format": "xml"},
    {"topic": "out", "keyy": "task_id"},
])  # fmt: skip
def test_a_sink_spec_that_cannot_be_meant_is_refused(spec: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        SinkSpec.model_validate(spec)


def _registry(tmp_path: Path, sink: dict[str, Any]) -> PipelineRegistry:
    spec = yaml.safe_load((ROOT / "pipelines" / "comment-analysis.yaml").read_text())
    (tmp_path / "comment-analysis.yaml").write_text(yaml.safe_dump({**spec, "sink": sink}))
    return PipelineRegistry.load(tmp_path, ROOT / "schemas")


async def test_a_sink_record_over_its_topics_limit_makes_the_task_a_dead_letter(
    tmp_path: Path, make_processor: MakeProcessor
) -> None:
    registry = _registry(tmp_path, {"topic": "small", "dead_letters": "small.dlq"})
    processor = make_processor(FakeLLM(lambda _r: answer(GOOD)), registry=registry,
                               limits=ValueLimits(others={"small": 300}))  # fmt: skip
    task = {"task_id": "t-1", "pipeline": "comment-analysis",
            "input": {"text": "Arrived late, works great."}}  # fmt: skip
    out = await processor.process(orjson.dumps(task), b"t-1", Source(topic="t", partition=0,
                                                                      offset=1))  # fmt: skip
    assert out.kind == "dead_letter" and out.error is not None
    assert out.error["code"] == "sink_too_large" and "small takes" in out.error["message"]
    assert out.sink is not None and out.sink.topic == "small.dlq"  # its copy, for the pipeline
    fits = make_processor(FakeLLM(lambda _r: answer(GOOD)), registry=registry)
    ok = await fits.process(orjson.dumps(task), b"t-1", Source(topic="t", partition=0, offset=2))
    assert ok.kind == "result" and ok.sink is not None and ok.sink.topic == "small"
    assert orjson.loads(ok.sink.value)["llm"]["output"]["sentiment"] == GOOD["sentiment"]


@pytest.mark.parametrize("sink", [
    {"topic": "out", "shape": "output"},
    {"topic": "out", "shape": "envelope"},
    {"topic": "out"},
    {"topic": "out", "field": "analysis", "fields": {"sentiment": "/sentiment"}},
])  # fmt: skip
async def test_each_shape_has_a_value_schema_its_records_meet(
    tmp_path: Path, make_processor: MakeProcessor, sink: dict[str, Any]
) -> None:
    """The schema a `json_schema` sink registers: derived from the pipeline's output schema,
    met by the records the sink writes, refusing a record without the answer."""
    registry = _registry(tmp_path, sink)
    processor = make_processor(FakeLLM(lambda _r: answer(GOOD)), registry=registry)
    task = {"task_id": "t-1", "pipeline": "comment-analysis",
            "input": {"text": "Late again, sadly."}}  # fmt: skip
    out = await processor.process(orjson.dumps(task), b"t-1", Source(topic="t", partition=0,
                                                                      offset=1))  # fmt: skip
    assert out.kind == "result" and out.sink is not None
    pipeline = registry.get("comment-analysis")
    assert pipeline.spec.sink is not None
    schema = value_schema(pipeline.spec.sink, pipeline.output_schema)
    validator = Draft202012Validator(schema)
    validator.validate(orjson.loads(out.sink.value))
    assert not validator.is_valid({"text": "no answer here"})


def test_an_output_schema_with_definitions_cannot_be_nested_and_says_so() -> None:
    with pytest.raises(ConfigError, match=r"\$defs"):
        value_schema(SinkSpec(topic="out"), {"type": "object", "$defs": {"a": {}}})


@pytest.mark.parametrize("shape", ["output", "envelope"])
async def test_an_avro_sink_writes_records_its_registered_schema_reads_back(
    tmp_path: Path, make_processor: MakeProcessor, shape: str
) -> None:
    """The Avro schema derived from the output schema (and the result record's) takes the
    sink's record, and a reader with that schema gets the same answer back."""
    import io

    import fastavro

    registry = _registry(tmp_path, {"topic": "out.avro", "shape": shape, "format": "avro"})
    processor = make_processor(FakeLLM(lambda _r: answer(GOOD)), registry=registry)
    task = {"task_id": "t-1", "pipeline": "comment-analysis",
            "input": {"text": "Late again, sadly."}}  # fmt: skip
    out = await processor.process(orjson.dumps(task), b"t-1", Source(topic="t", partition=0,
                                                                      offset=1))  # fmt: skip
    assert out.sink is not None
    pipeline = registry.get("comment-analysis")
    assert pipeline.spec.sink is not None
    kind, schema = registered_schema(pipeline.spec.sink, pipeline.output_schema)
    assert kind == "AVRO" and schema["type"] == "record"
    framed = framing(kind, schema, 7)(out.sink.value)
    assert framed[:5] == b"\x00\x00\x00\x00\x07"
    back = fastavro.schemaless_reader(io.BytesIO(framed[5:]), fastavro.parse_schema(schema))
    expected = orjson.loads(out.sink.value)
    assert back == expected


def test_what_avro_cannot_say_is_refused_with_where_it_is() -> None:
    spec = SinkSpec(topic="out", format="avro")  # enriched: its source's schema, at start
    with pytest.raises(ConfigError, match="source topic's Avro schema from the registry"):
        registered_schema(spec, {"type": "object", "properties": {"a": {"type": "string"}}})
    loose = {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"description": "anything"}}}}}  # fmt: skip
    with pytest.raises(ConfigError, match=r"at \.a\.b has no single type"):
        avro_schema(loose, "Value", "ns")
    with pytest.raises(ConfigError, match="a name Avro does not allow"):
        avro_schema({"type": "object", "properties": {"a-b": {"type": "string"}}}, "V", "ns")
    mixed = avro_schema({"type": "object", "required": ["e", "n"], "properties": {
        "e": {"type": "string", "enum": ["ok", "not ok"]},  # not Avro names: a string
        "n": {"type": ["integer", "null"]}, "o": {"type": "number"}}}, "V", "ns")  # fmt: skip
    assert [f["type"] for f in mixed["fields"]] == ["string", ["null", "long"], ["null", "double"]]
    assert mixed["fields"][2]["default"] is None
    # An object of free names whose values are alike (a result's cost_by_deployment): a map.
    priced = avro_schema({"type": "object", "required": ["by"], "properties": {"by": {
        "type": "object", "additionalProperties": {"type": "number"}}}}, "V", "ns")  # fmt: skip
    assert priced["fields"][0]["type"] == {"type": "map", "values": "double"}
    with pytest.raises(ConfigError, match=r"at \.by has an object without declared properties"):
        avro_schema({"type": "object", "properties": {"by": {"type": "object"}}}, "V", "ns")


def test_pipelines_validate_says_each_sink_and_refuses_one_avro_cannot_write(
    tmp_path: Path,
) -> None:
    from click.testing import CliRunner

    from streams.cli import cli

    spec = yaml.safe_load((ROOT / "pipelines" / "comment-analysis.yaml").read_text())
    spec["sink"] = {"topic": "shop.scored", "shape": "output", "format": "avro"}
    (tmp_path / "comment-analysis.yaml").write_text(yaml.safe_dump(spec))
    run = CliRunner().invoke(cli, ["pipelines", "validate", "--dir", str(tmp_path)])
    assert run.exit_code == 0, run.output
    assert "sink comment-analysis: shop.scored (output, key task_id, avro)" in run.output
    schemas = tmp_path / "schemas"
    schemas.mkdir()
    loose = {"type": "object", "required": ["note"], "properties": {"note": {}}}  # any type
    (schemas / "loose.schema.json").write_text(orjson.dumps(loose).decode())
    pipelines = tmp_path / "loose"
    pipelines.mkdir()
    (pipelines / "notes.yaml").write_text(yaml.safe_dump({
        "name": "notes", "default_version": "v1", "output_schema": "loose.schema.json",
        "sink": {"topic": "notes.out", "shape": "output", "format": "avro"},
        "versions": {"v1": {"params": {"max_tokens": 100}, "slots": {"text": {"type": "string"}},
                            "system": "Note it.", "template": "{{ text }}"}},
    }))  # fmt: skip
    run = CliRunner().invoke(cli, ["pipelines", "validate", "--dir", str(pipelines)],
                             env={"LLM_STREAMS_SCHEMAS_DIR": str(schemas)})  # fmt: skip
    assert run.exit_code == 1, run.output
    assert "invalid notes: sink: format avro: the answer's schema at .note has no single" in (
        run.output
    )


# A source's Avro schema as a registry holds it: a Debezium change event of a row whose
# columns include bytes, a decimal and a timestamp (JSON holds them as base64, an exact
# string and ISO 8601 on their way through llm-tasks).
ROW = {"type": "record", "name": "Value", "namespace": "shop.public.reviews", "fields": [
    {"name": "id", "type": "int"},
    {"name": "body", "type": ["null", "string"], "default": None},
    {"name": "photo", "type": ["null", "bytes"], "default": None},
    {"name": "price", "type": {"type": "bytes", "logicalType": "decimal", "precision": 8,
                               "scale": 2}},
    {"name": "at", "type": {"type": "long", "logicalType": "timestamp-millis"}}]}  # fmt: skip
ENVELOPE = {"type": "record", "name": "Envelope", "namespace": "shop.public.reviews",
            "fields": [{"name": "before", "type": ["null", ROW], "default": None},
                       {"name": "after", "type": ["null", "shop.public.reviews.Value"],
                        "default": None},
                       {"name": "op", "type": "string"}]}  # fmt: skip


def test_an_enriched_avro_record_is_the_source_record_with_the_answer_in_its_schema() -> None:
    """The source's own schema with the provenance and the fields by pointer added; the
    record, as JSON holds it, framed in that schema and read back with the source's
    values as the source wrote them."""
    import base64
    import datetime as dt
    import io
    from decimal import Decimal

    import fastavro

    from streams.schema_registry import jsonable

    output = orjson.loads((ROOT / "schemas" / "comment-analysis.output.schema.json").read_text())
    spec = SinkSpec(topic="shop.reviews.analysed", format="avro",
                    fields={"sentiment": "/sentiment", "first_topic": "/topics/0"})  # fmt: skip
    kind, schema = registered_schema(spec, output, ENVELOPE)
    assert kind == "AVRO" and schema["name"] == "Envelope"  # the source's record, named so
    names = [f["name"] for f in schema["fields"]]
    assert names == ["before", "after", "op", "llm", "sentiment", "first_topic"]
    assert schema["fields"][4]["type"][0] == "null"  # the answer may have none there
    row = {"id": 7, "body": "Late again.", "photo": b"\x89PNG", "price": Decimal("19.90"),
           "at": dt.datetime(2026, 12, 2, 3, 0, tzinfo=dt.UTC)}  # fmt: skip
    event = {"before": None, "after": row, "op": "u"}
    task = Task.model_validate({
        "task_id": "r-7", "pipeline": "reviews", "input": {"text": "Late again."},
        "source_record": {"topic": "shop.public.reviews", "partition": 0, "offset": 3,
                          "key": {"id": 7}, "value": jsonable(event)},
    })  # fmt: skip
    assert task.source_record is not None
    assert task.source_record.value["after"]["photo"] == base64.b64encode(b"\x89PNG").decode()
    sink = result_record(spec, task, RESULT)
    framed = framing(kind, schema, 11)(sink.value)
    back = fastavro.schemaless_reader(io.BytesIO(framed[5:]), fastavro.parse_schema(schema))
    assert back["after"] == row and back["op"] == "u" and back["before"] is None
    assert back["llm"]["result_key"] == "rk-1" and back["llm"]["model"] == "m"
    assert back["sentiment"] == "negative"  # the answer's fields beside the record's
    assert back["first_topic"] == "delivery"


def test_an_enriched_avro_sink_refuses_what_the_source_schema_cannot_take() -> None:
    output = orjson.loads((ROOT / "schemas" / "comment-analysis.output.schema.json").read_text())
    with pytest.raises(ConfigError, match=r"adds \['op'\], which the source's record has"):
        registered_schema(SinkSpec(topic="o", format="avro", field="op"), output, ENVELOPE)
    with pytest.raises(ConfigError, match="nothing at /no/such"):
        registered_schema(SinkSpec(topic="o", format="avro", fields={"x": "/no/such"}), output,
                          ENVELOPE)  # fmt: skip
    with pytest.raises(ConfigError, match="values to be Avro records"):
        registered_schema(SinkSpec(topic="o", format="avro"), output, {"type": "string"})
    spec = SinkSpec(topic="o", format="avro")
    kind, schema = registered_schema(spec, output, ENVELOPE)
    value = orjson.dumps({"before": None, "after": {"id": "seven"}, "op": "c",
                          "llm": {}})  # fmt: skip
    with pytest.raises((ValueError, TypeError, KeyError)):  # the writer: Unencodable
        framing(kind, schema, 1)(value)
    not_a_price = orjson.dumps({"before": None, "op": "c", "llm": {}, "after": {
        "id": 1, "price": "n/a", "at": "2026-12-02T03:00:00+00:00"}})  # fmt: skip
    with pytest.raises(ArithmeticError):  # decimal.InvalidOperation: the writer's too
        framing(kind, schema, 1)(not_a_price)
