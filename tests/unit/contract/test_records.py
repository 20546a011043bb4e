from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import orjson
import pytest

from streams.contract.records import (
    MAX_DEPTH,
    MESSAGE_LIMIT,
    DeadLetter,
    Source,
    content_key,
    contract_schemas,
    dead_letter_value,
    decode_task,
    error_info,
    payload_of,
    result_key,
    task_id_hint,
    task_keys,
    too_deep,
)
from streams.errors import Category, InvalidInput

SCHEMAS = Path(__file__).resolve().parents[3] / "schemas"


def test_schema_files_equal_the_models() -> None:
    for filename, schema in contract_schemas().items():
        on_disk = json.loads((SCHEMAS / filename).read_text(encoding="utf-8"))
        assert on_disk == schema, (
            f"{filename} is stale: run `python -m streams.contract.records schemas`"
        )


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


def test_a_tasks_keys_made_together_are_its_keys_as_written_before() -> None:
    """`task_keys` (the worker's, its input made canonical once) gives the keys earlier
    versions wrote, with a session's context and without: stored results stay found."""
    task_input = {"text": "he\u0301llo", "n": 1}
    assert task_keys("comment-analysis", "v1", "t-1", task_input) == (
        "rk1-708e49297710d3c1d8729a9dd8d5dbbbfa968670",
        "ck1-0d2a5d2240830542591057dfcae8ca0545302366",
    )
    assert task_keys("comment-analysis", "v1", "t-1", task_input, "ctx") == (
        "rk1-3bac97abad72f2e6828cecdec5f85328d657e0ba",
        "ck1-a5382576b31d03b1719411410ad9d12b254eb1f7",
    )
    for context in (None, "ctx"):
        assert task_keys("p", "v2", "t-2", {"a": [1, "x"]}, context) == (
            result_key("p", "v2", "t-2", {"a": [1, "x"]}, context),
            content_key("p", "v2", {"a": [1, "x"]}, context),
        )


def test_payload_keeps_json_or_base64_of_the_bytes() -> None:
    assert payload_of(b'{"a": 1}') == {"a": 1}
    assert payload_of(b"\xff\x00") == {"raw_base64": "/wA="}
    assert payload_of(None) == {"raw_base64": ""}


def nested(levels: int) -> bytes:
    """A task whose input nests objects and arrays `levels` deep, the task itself counted."""
    inner = b'{"x": [' * ((levels - 2) // 2) + b"1" + b"]}" * ((levels - 2) // 2)
    return b'{"task_id": "t", "pipeline": "p", "input": {"a": ' + inner + b"}}"


def test_a_record_nested_deeper_than_it_could_be_written_back_is_refused_at_decode() -> None:
    """orjson reads 1,024 levels and writes 254: a task nested 300 deep decoded, and then
    neither its keys, nor its answer, nor its dead letter (its payload) could be written."""
    assert decode_task(nested(MAX_DEPTH), max_bytes=10_000).task_id == "t"
    with pytest.raises(TypeError):  # what the decode used to let through
        orjson.dumps(orjson.loads(nested(300)))
    for levels in (MAX_DEPTH + 2, 300, 1000):
        with pytest.raises(InvalidInput) as caught:
            decode_task(nested(levels), max_bytes=10_000)
        assert (
            caught.value.code == "too_deep" and f"over {MAX_DEPTH} levels" in caught.value.message
        )
        # Its dead letter keeps the bytes, as for a record that is not JSON.
        payload = payload_of(nested(levels))
        assert base64.b64decode(payload["raw_base64"]) == nested(levels)
        error = error_info(Category.INVALID_INPUT, "too_deep", "m", False)
        letter = DeadLetter(task_id="t", error=error, attempts=0, payload=payload,
                            source=Source(topic="t", partition=0, offset=0),
                            failed_at="2026-12-05T00:00:00Z")  # fmt: skip
        assert (
            orjson.loads(dead_letter_value(letter, nested(levels), 100_000))["payload"] == payload
        )


def test_a_dead_letter_whose_payload_does_not_write_back_keeps_its_head() -> None:
    """The last resort of the one way a record ends when nothing else can be written:
    whatever its payload holds, its dead letter is written (before, it raised, the record
    was never acked and its partition's commit stopped behind it)."""
    deep: list[object] = []
    for _ in range(300):
        deep = [deep]
    raw = orjson.dumps({"task_id": "t", "note": "read with a reader of our own"})
    letter = DeadLetter(task_id="t", error=error_info(Category.INTERNAL_ERROR, "c", "m", False),
                        attempts=0, payload=deep, source=Source(topic="t", partition=0, offset=0),
                        failed_at="2026-12-05T00:00:00Z")  # fmt: skip
    kept = orjson.loads(dead_letter_value(letter, raw, 100_000))["payload"]
    assert kept["truncated"] and kept["size"] == len(raw) and kept["head"] == raw.decode()
    assert kept["sha256"] == hashlib.sha256(raw).hexdigest()


def test_depth_is_counted_in_levels_not_brackets() -> None:
    wide = [{"a": [i]} for i in range(5000)]  # 10,000 brackets, three levels
    assert not too_deep(wide, orjson.dumps(wide))
    chain: list[object] = []
    for _ in range(MAX_DEPTH - 1):
        chain = [chain]
    assert not too_deep(chain) and too_deep([chain]) and too_deep({"k": [chain]})
    assert not too_deep("text", b'"[[[["') and not too_deep(7)


def test_task_id_hint_from_value_then_key() -> None:
    assert task_id_hint(b'{"task_id": "abc"}', b"k") == "abc"
    assert task_id_hint(b"junk", b"k") == "k"
    assert task_id_hint(b"junk", b"\xff") is None


def _letter(payload: object, message: str = "too large") -> DeadLetter:
    return DeadLetter(
        task_id="t1", error=error_info(Category.INVALID_INPUT, "too_large", message, False),
        attempts=0, payload=payload, source=Source(topic="t", partition=0, offset=1),
        failed_at="2026-01-01T00:00:00.000Z",
    )  # fmt: skip


def test_a_dead_letter_that_fits_keeps_its_payload_whole() -> None:
    raw = orjson.dumps({"task_id": "t1", "input": {"text": "short"}})
    value = dead_letter_value(_letter(payload_of(raw)), raw, max_bytes=10_000)
    assert orjson.loads(value)["payload"] == {"task_id": "t1", "input": {"text": "short"}}


@pytest.mark.parametrize("max_bytes", [2_000, 50_000, 300_000])
def test_a_large_dead_letter_keeps_a_head_its_size_and_sha256_within_room(max_bytes: int) -> None:
    text = 'quote " backslash \\ ctl \x01 中文 ' * 40_000  # escapes grow the JSON
    raw = orjson.dumps({"task_id": "t1", "pipeline": "p", "input": {"text": text}})
    value = dead_letter_value(_letter(payload_of(raw)), raw, max_bytes=max_bytes)
    assert len(value) <= max_bytes
    payload = orjson.loads(value)["payload"]
    assert payload["truncated"] is True and payload["size"] == len(raw)
    assert payload["sha256"] == hashlib.sha256(raw).hexdigest()
    assert raw.decode().startswith(payload["head"]) and len(payload["head"]) > max_bytes // 10


def test_a_large_record_that_is_not_utf8_keeps_a_base64_head() -> None:
    raw = b"\xff\xfe" + bytes(range(256)) * 4000
    value = dead_letter_value(_letter(payload_of(raw)), raw, max_bytes=20_000)
    payload = orjson.loads(value)["payload"]
    assert len(value) <= 20_000 and "head" not in payload
    assert raw.startswith(base64.b64decode(payload["head_base64"]))


def test_an_error_message_is_capped() -> None:
    info = error_info(Category.INVALID_OUTPUT, "x", "y" * 100_000, True)
    assert len(info.message) < MESSAGE_LIMIT + 50 and info.message.endswith("characters)")


def test_a_task_id_hint_longer_than_the_contract_allows_is_no_hint() -> None:
    assert task_id_hint(orjson.dumps({"task_id": "x" * 600}), b"k") == "k"
    assert task_id_hint(None, b"k" * 600) is None


def test_every_error_category_is_in_the_dead_letter_schema() -> None:
    schema = contract_schemas()["dead-letter.schema.json"]
    assert schema["$defs"]["Category"]["enum"] == [c.value for c in Category]


def test_a_field_a_newer_worker_adds_to_a_source_record_is_passed_over() -> None:
    """A rolling upgrade: the newer worker's source ingest writes a field this version
    does not know into `source_record`. The task was `invalid_input` here; the task's own
    fields stay strict (a user's typo in them is an error)."""
    import pydantic

    from streams.contract.records import Task

    task = {"task_id": "t", "pipeline": "p", "input": {"text": "x"},
            "source_record": {"topic": "reviews", "key": "k", "added_later": {"v": 2}}}  # fmt: skip
    read = Task.model_validate(task)
    assert read.source_record is not None and read.source_record.key == "k"
    with pytest.raises(pydantic.ValidationError):
        Task.model_validate({**task, "inputs": {"text": "typo"}})
