"""Wire models of the public record contract v1 (DESIGN.md) and the task decoder.

`schemas/{task,result,dead-letter}.schema.json` are generated from these
models and a test keeps them equal.
"""

from __future__ import annotations

import base64
import hashlib
import unicodedata
from datetime import UTC, datetime
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from streams.errors import Category, InvalidInput


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Task(_Record):
    """An input record: one unit of LLM work, keyed by task_id."""

    task_id: str = Field(min_length=1, max_length=512)
    pipeline: str = Field(min_length=1, max_length=128)
    input: dict[str, Any] = Field(min_length=1)
    prompt_version: str | None = Field(None, min_length=1, max_length=64)
    metadata: dict[str, Any] | None = None


class Usage(_Record):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)


class Source(_Record):
    topic: str
    partition: int = Field(ge=0)
    offset: int = Field(ge=0)


class Result(_Record):
    """One answered task; key = result_key."""

    task_id: str
    result_key: str
    pipeline: str
    prompt_version: str
    model: str
    output: dict[str, Any]
    usage: Usage
    cost_usd: float = Field(ge=0)
    attempts: int = Field(ge=0)
    latency_ms: float = Field(ge=0)
    cached: bool
    source: Source
    trace_id: str | None
    processed_at: str


class ErrorInfo(_Record):
    category: Literal[
        "invalid_input",
        "context_overflow",
        "rate_limited",
        "timeout",
        "upstream_error",
        "auth",
        "bad_request",
        "invalid_output",
        "circuit_open",
        "deadline_exceeded",
    ]
    code: str
    message: str
    retryable: bool


class DeadLetter(_Record):
    """A record that could not be answered, with the original payload kept."""

    task_id: str | None
    error: ErrorInfo
    attempts: int = Field(ge=0)
    payload: Any
    source: Source
    failed_at: str


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _nfc(value: Any) -> Any:
    if isinstance(value, str):
        return unicodedata.normalize("NFC", value)
    if isinstance(value, dict):
        return {_nfc(k): _nfc(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nfc(v) for v in value]
    return value


def canonical_input(task_input: dict[str, Any]) -> bytes:
    """Canonical bytes of a task input: NFC strings, sorted keys, compact JSON."""
    return orjson.dumps(_nfc(task_input), option=orjson.OPT_SORT_KEYS)


def result_key(pipeline: str, prompt_version: str, task_id: str, task_input: dict[str, Any]) -> str:
    """Deterministic key of a result: same task, same version, same input -> same key."""
    h = hashlib.sha256()
    for part in (pipeline, prompt_version, task_id):
        encoded = part.encode()
        h.update(len(encoded).to_bytes(4, "big"))
        h.update(encoded)
    h.update(canonical_input(task_input))
    return "rk1-" + h.hexdigest()[:40]


def content_key(pipeline: str, prompt_version: str, task_input: dict[str, Any]) -> str:
    """Key of what is asked, whoever asks: identical inputs under one version share it."""
    h = hashlib.sha256()
    for part in (pipeline, prompt_version):
        encoded = part.encode()
        h.update(len(encoded).to_bytes(4, "big"))
        h.update(encoded)
    h.update(canonical_input(task_input))
    return "ck1-" + h.hexdigest()[:40]


def payload_of(raw: bytes | None) -> Any:
    """The original record as JSON when it is JSON, else its bytes in base64."""
    if raw is not None:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return {"raw_base64": base64.b64encode(raw or b"").decode()}


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(p) for p in err["loc"]) or "record"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def decode_task(raw: bytes | None, *, max_bytes: int) -> Task:
    """Decode and validate one task record; raise InvalidInput saying what is wrong."""
    if raw is None:
        raise InvalidInput("record has no value (tombstone)", code="empty_record")
    if len(raw) > max_bytes:
        raise InvalidInput(
            f"record is {len(raw)} bytes, over the {max_bytes}-byte limit", code="too_large"
        )
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"record is not JSON: {exc}", code="not_json") from exc
    if not isinstance(data, dict):
        raise InvalidInput(
            f"record is JSON {type(data).__name__}, not an object", code="not_an_object"
        )
    try:
        return Task.model_validate(data)
    except ValidationError as exc:
        raise InvalidInput(f"record breaks the task contract: {_describe(exc)}") from exc


def task_id_hint(raw: bytes | None, key: bytes | None) -> str | None:
    """Best guess of the task id of a record that failed to decode, for its dead letter."""
    if raw:
        try:
            data = orjson.loads(raw)
            if isinstance(data, dict) and isinstance(data.get("task_id"), str) and data["task_id"]:
                return str(data["task_id"])
        except orjson.JSONDecodeError:
            pass
    if key:
        try:
            return key.decode()
        except UnicodeDecodeError:
            return None
    return None


def error_info(category: Category, code: str, message: str, retryable: bool) -> ErrorInfo:
    return ErrorInfo(category=category.value, code=code, message=message, retryable=retryable)


def contract_schemas() -> dict[str, dict[str, Any]]:
    """JSON Schemas of the record contract, as kept in `schemas/`."""
    out = {}
    for name, model in (("task", Task), ("result", Result), ("dead-letter", DeadLetter)):
        schema = model.model_json_schema()
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        schema["$id"] = f"{name}.schema.json"
        out[f"{name}.schema.json"] = schema
    return out


def write_contract_schemas(directory: str) -> None:
    import json
    from pathlib import Path

    for filename, schema in contract_schemas().items():
        text = json.dumps(schema, indent=2, ensure_ascii=False, sort_keys=True) + "\n"
        (Path(directory) / filename).write_text(text, encoding="utf-8")


if __name__ == "__main__":
    import sys

    write_contract_schemas(sys.argv[1] if len(sys.argv) > 1 else "schemas")
