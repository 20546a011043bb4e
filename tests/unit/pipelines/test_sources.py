"""Sources: a record of an existing topic mapped to a task of its pipeline, skipped, or
refused with the reason (which becomes an invalid_input dead letter)."""

from __future__ import annotations

import base64
import shutil
from pathlib import Path

import orjson
import pytest

from streams.errors import ConfigError, InvalidInput
from streams.pipelines.registry import PipelineRegistry
from streams.pipelines.sinks import SinkSpec
from streams.pipelines.sources import Erase, Skipped, SourceMapper, SourceSpec, pointer_get

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def registry(tmp_path: Path) -> PipelineRegistry:
    for example in (ROOT / "examples" / "sources").glob("*.yaml"):
        shutil.copy(example, tmp_path)
    return PipelineRegistry.load(tmp_path, ROOT / "schemas")


def _change(op: str, after: dict[str, object] | None) -> bytes:
    return orjson.dumps({"schema": {}, "payload": {"op": op, "before": None, "after": after,
                                                   "source": {"table": "reviews"}}})  # fmt: skip


def test_the_shipped_debezium_example_maps_changes_and_erases_deletes(
    registry: PipelineRegistry,
) -> None:
    (cdc,) = registry.sources()["shop.public.reviews"]
    row = {"id": 42, "body": "The zip broke after two days.", "product_name": "Bag", "stars": 1}
    for op in ("c", "u", "r"):
        assert cdc.task(_change(op, row), b'{"id": 42}') == {
            "task_id": "review-42", "pipeline": "reviews-cdc",
            "input": {"text": "The zip broke after two days.", "product": "Bag", "rating": "1"},
        }  # fmt: skip
    # A delete erases the review's task; Debezium's tombstone after it is skipped.
    delete = orjson.dumps({"schema": {}, "payload": {"op": "d", "before": row, "after": None}})
    assert cdc.task(delete, b'{"id": 42}') == Erase("review-42", '{"id": 42}')
    assert cdc.task(None, b'{"id": 42}') == Skipped("tombstone")
    with pytest.raises(InvalidInput) as refused:  # a delete that names no row
        cdc.task(_change("d", None), b"k")
    assert refused.value.code == "source_erase"
    prompt = (
        registry.get("reviews-cdc")
        .versions["v1"]
        .render(
            cdc.task(_change("c", row), None)["input"],
            "m",  # type: ignore[index]
        )
    )
    assert "The zip broke after two days." in prompt.messages[1]["content"]


def test_the_shipped_avro_example_maps_a_decoded_change_and_its_decoded_key(
    registry: PipelineRegistry,
) -> None:
    (avro,) = registry.sources()["shop.public.reviews.avro"]
    assert (avro.spec.format, avro.spec.key_format) == ("registry", "registry")
    row = {"id": 42, "body": "The zip broke.", "product_name": "Bag", "stars": 1}
    change = {"op": "u", "before": None, "after": row, "ts_ms": 1}
    assert avro.map(change, {"id": 42}) == {
        "task_id": "review-42", "pipeline": "reviews-avro",
        "input": {"text": "The zip broke.", "product": "Bag", "rating": "1"},
    }  # fmt: skip
    assert avro.map({**change, "op": "d"}, {"id": 42}) == Skipped("filter")


@pytest.mark.parametrize(
    ("key", "task_id"),
    [(b"c-1", "c-1"), (17, "17"), ({"b": 2, "a": 1}, '{"a":1,"b":2}')],
)
def test_task_id_key_takes_a_raw_key_a_decoded_scalar_or_a_structure(
    key: object, task_id: str
) -> None:
    mapper = SourceMapper("p", SourceSpec(topics=["t"], task_id="key", slots={"text": "/t"}))
    assert mapper.map({"t": "x"}, key) == {"task_id": task_id, "pipeline": "p",
                                          "input": {"text": "x"}}  # fmt: skip


def test_keys_that_are_not_utf8_stay_apart_and_a_sink_keeps_their_bytes() -> None:
    # Java's LongSerializer: 8 big-endian bytes. 255 and 254 end in bytes that are no
    # UTF-8; read with replacement characters they were one task id.
    keys = [n.to_bytes(8, "big") for n in (65, 254, 255, 1 << 62 | 200)]
    sink = SinkSpec(topic="out", key="source_key")
    mapper = SourceMapper("p", SourceSpec(topics=["t"], slots={"k": "{{ key }}"},
                                          erase={"when": "value is none"}), sink)  # fmt: skip
    tasks = [mapper.task(b'{"t": "x"}', key) for key in keys]
    ids = [t["task_id"] for t in tasks]  # type: ignore[index]
    assert len(set(ids)) == len(keys)
    assert ids[0] == "\x00" * 7 + "A"  # UTF-8 keys read as they always did
    assert ids[1] == "base64:" + base64.b64encode(keys[1]).decode()
    assert [t["input"]["k"] for t in tasks] == ids  # type: ignore[index]
    kept = [t["source_record"] for t in tasks]  # type: ignore[index]
    assert "key_base64" not in kept[0]  # only when needed: older readers forbid it
    assert [base64.b64decode(k["key_base64"]) for k in kept[1:]] == keys[1:]
    # A header carried over keeps its bytes the same way (the last of a name, as ever).
    carried = SourceMapper("p", SourceSpec(topics=["t"], slots={"t": "/t"}),
                           SinkSpec(topic="out", headers=["id", "tenant"]))  # fmt: skip
    guid = bytes(range(0x80, 0x90))
    kept_headers = carried.task(b'{"t": "x"}', b"k", [("id", b"old"), ("id", guid),
                                                      ("tenant", b"acme"), ("x", guid)])  # fmt: skip
    record = kept_headers["source_record"]  # type: ignore[index]
    assert record["headers_base64"] == {"id": base64.b64encode(guid).decode()}
    assert record["headers"] == {"id": guid.decode(errors="replace"), "tenant": "acme"}
    plain = carried.task(b'{"t": "x"}', b"k", [("id", guid), ("id", b"new")])
    assert "headers_base64" not in plain["source_record"]  # type: ignore[index]
    erase = mapper.task(None, keys[2])
    assert erase == Erase(ids[2], ids[2], None, base64.b64encode(keys[2]).decode())
    assert isinstance(erase, Erase) and base64.b64decode(erase.key_base64 or "") == keys[2]


def test_a_plain_json_topic_takes_its_task_id_from_the_key(registry: PipelineRegistry) -> None:
    (plain,) = registry.sources()["app.comments"]
    task = plain.task(b'{"comment": {"text": "Love it"}, "user": 7}', b"c-9")
    assert task == {"task_id": "c-9", "pipeline": "plain-comments", "input": {"text": "Love it"}}
    # After a UTF-8 byte order mark (a file a Windows tool wrote, produced line by line).
    assert plain.task(b'\xef\xbb\xbf{"comment": {"text": "Love it"}}', b"c-9") == task


@pytest.mark.parametrize(
    ("value", "key", "code"),
    [
        (b"{not json", b"k", "source_not_json"),
        (b'{"comment": {}}', b"k", "source_pointer"),  # nothing at /comment/text
        (b'{"comment": {"text": "hi"}}', None, "source_key"),  # task_id from a missing key
    ],
)
def test_what_cannot_be_mapped_is_invalid_input_with_the_reason(
    registry: PipelineRegistry, value: bytes, key: bytes | None, code: str
) -> None:
    (plain,) = registry.sources()["app.comments"]
    with pytest.raises(InvalidInput) as caught:
        plain.task(value, key)
    assert caught.value.code == code


def test_task_ids_from_a_pointer_or_a_hash_of_fields() -> None:
    by_pointer = SourceMapper("p", SourceSpec(topics=["t"], task_id="/id", slots={"text": "/t"}))
    assert by_pointer.task(b'{"id": 7, "t": "x"}', None)["task_id"] == "7"  # type: ignore[index]
    with pytest.raises(InvalidInput, match="not a string or an integer"):
        by_pointer.task(b'{"id": {"a": 1}, "t": "x"}', None)
    hashed = SourceMapper("p", SourceSpec(topics=["t"], task_id=["/shop", "/n"],
                                          slots={"text": "/t"}))  # fmt: skip
    one = hashed.task(b'{"shop": "s", "n": 1, "t": "x"}', None)
    again = hashed.task(b'{"n": 1, "shop": "s", "t": "other text"}', None)
    other = hashed.task(b'{"shop": "s", "n": 2, "t": "x"}', None)
    assert one["task_id"] == again["task_id"] != other["task_id"]  # type: ignore[index]
    assert one["task_id"].startswith("p-")  # type: ignore[index]


def test_an_index_that_is_not_ascii_digits_points_at_nothing() -> None:
    # "²".isdigit() is true but int("²") fails: a ValueError past the mapper's handler.
    mapper = SourceMapper("p", SourceSpec(topics=["t"], task_id="/id",
                                          slots={"text": "/texts/²"}))  # fmt: skip
    with pytest.raises(InvalidInput, match="nothing at /texts/²") as caught:
        mapper.task(b'{"id": 1, "texts": ["a", "b", "c"]}', None)
    assert caught.value.code == "source_pointer"
    assert pointer_get({"a": ["x", "y"]}, "/a/1") == "y"


def test_slots_from_jinja_see_key_headers_and_timestamp() -> None:
    mapper = SourceMapper("p", SourceSpec(topics=["t"], slots={
        "text": "{{ value.body }} ({{ headers['shop'] }}, {{ key }}, {{ timestamp | int }})"}))  # fmt: skip
    task = mapper.task(b'{"body": "ok"}', b"k1", [("shop", b"eu")], 1764500000.0)
    assert task["input"] == {"text": "ok (eu, k1, 1764500000)"}  # type: ignore[index]


def test_a_source_that_leaves_a_required_slot_unmapped_stops_the_start(tmp_path: Path) -> None:
    text = (ROOT / "examples" / "sources" / "plain-comments.yaml").read_text()
    (tmp_path / "p.yaml").write_text(text.replace("    text: /comment/text\n",
                                                  "    title: /comment/title\n"))  # fmt: skip
    with pytest.raises(ConfigError, match=r"does not map the slots \['text'\]"):
        PipelineRegistry.load(tmp_path, ROOT / "schemas")


@pytest.mark.parametrize(
    ("spec", "value", "code", "reason"),
    [
        # a loosely typed upstream table: text where the filter compares a number
        ({"filter": "value.stars >= 1", "slots": {"text": "/t"}},
         b'{"stars": "4 stars", "t": "x"}', "source_filter", "TypeError: '>=' not supported"),
        ({"task_id": "r-{{ 10 // value.n }}", "slots": {"text": "/t"}},
         b'{"n": 0, "t": "x"}', "source_task_id", "ZeroDivisionError"),
        ({"slots": {"text": "{{ value.n | int * 10.0 ** 400 }}"}},
         b'{"n": 1}', "source_slot", "OverflowError"),
        ({"slots": {"text": "{{ value.t.upper() }}"}},
         b'{"t": 5}', "source_slot", "has no attribute"),  # Jinja's own message, as it is
    ],
)  # fmt: skip
def test_any_error_an_expression_meets_on_the_record_is_its_invalid_input(
    spec: dict[str, object], value: bytes, code: str, reason: str
) -> None:
    mapper = SourceMapper("p", SourceSpec(topics=["t"], **spec))  # type: ignore[arg-type]
    with pytest.raises(InvalidInput) as caught:
        mapper.task(value, b"k")
    assert caught.value.code == code
    assert reason in caught.value.message, caught.value.message


def test_a_header_without_a_value_is_null_in_the_templates() -> None:
    mapper = SourceMapper("p", SourceSpec(topics=["t"], slots={
        "text": "{{ value.body }} {{ headers['trace'] is none }} {{ headers['shop'] }}"}))  # fmt: skip
    task = mapper.task(b'{"body": "ok"}', b"k", [("trace", None), ("shop", b"eu")])
    assert task["input"] == {"text": "ok True eu"}  # type: ignore[index]


def test_a_delete_names_the_session_of_the_task_it_deletes() -> None:
    spec = SourceSpec(topics=["t"], task_id="/id", slots={"text": "/t"},
                      erase={"when": "value is not none and value.op == 'd'",
                             "task_id": "{{ value.id }}", "session_id": "{{ value.chat }}"})  # fmt: skip
    mapper = SourceMapper("p", spec)
    assert mapper.task(b'{"op": "d", "id": "m-1", "chat": "c-9"}', b"k") == Erase(
        "m-1", "k", "c-9")  # fmt: skip
    assert mapper.task(None, b"k") == Skipped("tombstone")  # `when` says no
    unguarded = SourceMapper("p", spec.model_copy(update={"erase": spec.erase.model_copy(  # type: ignore[union-attr]
        update={"when": "value.op == 'd'"})}))  # fmt: skip
    with pytest.raises(InvalidInput, match=r"erase\.when"):  # a tombstone's value is null
        unguarded.task(None, b"k")
