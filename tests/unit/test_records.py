from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest

from streams.errors import InvalidInput
from streams.records import contract_schemas, decode_task, payload_of, result_key, task_id_hint

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"


def test_schema_files_equal_the_models() -> None:
    for filename, schema in contract_schemas().items():
        on_disk = json.loads((SCHEMAS / filename).read_text(encoding="utf-8"))
        assert on_disk == schema, f"{filename} is stale: run `python -m streams.records schemas`"


def test_decode_valid_task() -> None:
    raw = orjson.dumps(
        {"task_id": "a", "pipeline": "p", "input": {"text": "hi"}, "metadata": {"x": 1}}
    )
    task = decode_task(raw, max_bytes=1000)
    assert task.task_id == "a" and task.input == {"text": "hi"} and task.prompt_version is None


@pytest.mark.parametrize(
    ("raw", "code", "words"),
    [
        (None, "empty_record", "tombstone"),
        (b"{nope", "not_json", "not JSON"),
        (b"[1]", "not_an_object", "list"),
        (b"null", "not_an_object", "NoneType"),
        (b'{"pipeline": "p", "input": {"a": 1}}', "invalid_input", "task_id"),
        (b'{"task_id": "", "pipeline": "p", "input": {"a": 1}}', "invalid_input", "task_id"),
        (b'{"task_id": "a", "input": {"a": 1}}', "invalid_input", "pipeline"),
        (b'{"task_id": "a", "pipeline": "p", "input": {}}', "invalid_input", "input"),
        (b'{"task_id": "a", "pipeline": "p", "input": "s"}', "invalid_input", "input"),
        (b'{"task_id": 5, "pipeline": "p", "input": {"a": 1}}', "invalid_input", "task_id"),
        (
            b'{"task_id": "a", "pipeline": "p", "input": {"a": 1}, "extra": 1}',
            "invalid_input",
            "extra",
        ),
    ],
)
def test_decode_rejects_bad_records_saying_what_is_wrong(
    raw: bytes | None, code: str, words: str
) -> None:
    with pytest.raises(InvalidInput) as info:
        decode_task(raw, max_bytes=1000)
    assert info.value.code == code
    assert words in info.value.message


def test_decode_rejects_oversized_records() -> None:
    raw = orjson.dumps({"task_id": "a", "pipeline": "p", "input": {"t": "x" * 2000}})
    with pytest.raises(InvalidInput) as info:
        decode_task(raw, max_bytes=1000)
    assert info.value.code == "too_large"
    assert "1000-byte limit" in info.value.message


def test_result_key_is_deterministic_and_sensitive_to_each_part() -> None:
    base = result_key("p", "v1", "t1", {"text": "héllo", "n": 1})
    assert base == result_key("p", "v1", "t1", {"n": 1, "text": "héllo"})  # key order
    assert base == result_key("p", "v1", "t1", {"text": "he\u0301llo", "n": 1})  # NFC
    variants = {
        result_key("q", "v1", "t1", {"text": "héllo", "n": 1}),
        result_key("p", "v2", "t1", {"text": "héllo", "n": 1}),
        result_key("p", "v1", "t2", {"text": "héllo", "n": 1}),
        result_key("p", "v1", "t1", {"text": "hello", "n": 1}),
        result_key("pv", "1", "t1", {"text": "héllo", "n": 1}),  # no ambiguity at part borders
    }
    assert base not in variants and len(variants) == 5


def test_payload_keeps_json_or_base64_of_the_bytes() -> None:
    assert payload_of(b'{"a": 1}') == {"a": 1}
    assert payload_of(b"\xff\x00") == {"raw_base64": "/wA="}
    assert payload_of(None) == {"raw_base64": ""}


def test_task_id_hint_from_value_then_key() -> None:
    assert task_id_hint(b'{"task_id": "abc"}', b"k") == "abc"
    assert task_id_hint(b"junk", b"k") == "k"
    assert task_id_hint(b"junk", b"\xff") is None
