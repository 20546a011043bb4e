"""Sources: existing topics read as they are, each record mapped to a task of a pipeline.

A pipeline file may declare `source:` — the topics it reads and how a record becomes
a task (record contract v1 stays the default: records in `llm-tasks` need no mapping):

    source:
      topics: [shop.public.reviews]          # read as they are (JSON values)
      task_id: "review-{{ value.payload.after.id }}"  # `key` (the record key), a JSON
                                             # pointer, a list of pointers (hashed), or a
                                             # Jinja template like this one
      filter: "value.payload.op in ['c', 'u', 'r']"   # Jinja; false: skipped, counted
      slots:
        text: /payload/after/body            # a JSON pointer into the value, or
        rating: "{{ value.payload.after.stars }}"    # a Jinja expression over value,
                                             # key, headers and timestamp
      prompt_version: v2                     # optional: pin one
      format: json                           # or `registry`: Avro / JSON Schema records in
                                             # the schema registry's wire format
      key_format: raw                        # or `registry`: the key is decoded too

With `format: registry`, the value is decoded first (`streams.schema_registry`, with
the registry of LLM_STREAMS_SCHEMA_REGISTRY__URL) and mapped as its JSON form; with
`key_format: registry` the key is decoded as well (`key` in templates is then the
decoded key; `task_id: key` is a decoded scalar as text, or a structure's canonical
JSON).

A mapped record becomes a task; one that is not for this pipeline (the filter says
no; a tombstone) is skipped; one that cannot be mapped (not JSON, a pointer that
finds nothing, a slot of the wrong type) is invalid input, with the reason. The
worker forwards each task to its task partition of `llm-tasks` (`worker.sources`),
from where it runs as any other.
"""

from __future__ import annotations

import base64
import hashlib
import sys
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import orjson
from jinja2 import TemplateError
from pydantic import BaseModel, Field, field_validator

from streams.contract.headers import Headers
from streams.contract.mistakes import WRITTEN
from streams.contract.records import TASK_ID_LIMIT, record_json, shallow
from streams.errors import ConfigError, InvalidInput
from streams.pipelines.jinja import ENV, over_record
from streams.pipelines.sinks import SinkSpec


class Sessions(Protocol):
    """Where a pipeline's tasks say their session (`specs.SessionSpec`)."""

    def session_of(self, task: Any) -> str | None: ...


class EraseSpec(BaseModel):
    """Which source records are deletes upstream (a Debezium delete, a tombstone), and the
    task each one deletes: its answers are erased wherever the worker wrote them."""

    model_config = WRITTEN

    when: str = Field(
        min_length=1,
        description="A Jinja expression over value (null for a tombstone), key, headers "
        "and timestamp: true when the record deletes its task.",
    )
    task_id: str | None = Field(
        None,
        description="The deleted task's id, a Jinja template like the source's (a delete "
        "event has no `after`); none: the source's own task_id rule.",
    )
    session_id: str | None = Field(
        None,
        description="For a pipeline that keeps sessions: the deleted task's session, a "
        "Jinja template (its turn leaves the session, on the session's partition).",
    )


class SourceSpec(BaseModel):
    model_config = WRITTEN

    topics: list[str] = Field(min_length=1)
    task_id: str | list[str] = "key"
    slots: dict[str, str] = Field(min_length=1)
    filter: str | None = None
    prompt_version: str | None = None
    format: Literal["json", "registry"] = "json"
    key_format: Literal["raw", "registry"] = "raw"
    erase: EraseSpec | None = None

    @field_validator("task_id")
    @classmethod
    def _task_id_is_a_key_or_pointers(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, str):
            if value != "key" and not value.startswith("/") and "{{" not in value:
                raise ValueError(f"task_id: {value!r} is neither `key`, a JSON pointer nor "
                                 "a Jinja template")  # fmt: skip
            return value
        if not value or not all(p.startswith("/") for p in value):
            raise ValueError("task_id: a list must name one or more JSON pointers")
        return value


def jsonable(value: Any) -> Any:
    """A decoded record as JSON holds it: a registry's bytes as base64, decimals, times
    and other scalars JSON has no type for as text."""

    def other(v: Any) -> Any:
        if isinstance(v, bytes | bytearray):
            return base64.b64encode(bytes(v)).decode()
        return str(v)

    return orjson.loads(orjson.dumps(value, default=other, option=orjson.OPT_NON_STR_KEYS))


@dataclass(frozen=True)
class Skipped:
    """A record that is not for this pipeline."""

    reason: str


@dataclass(frozen=True)
class Erase:
    """A record that deletes its task upstream: the task's answers are to be erased."""

    task_id: str
    key: Any  # the source record's key (a sink keyed by it is erased under it)
    session_id: str | None = None
    key_base64: str | None = None  # its bytes, when they are not UTF-8 (`base64_unless_utf8`)


def pointer_get(document: Any, pointer: str) -> Any:
    """RFC 6901: the value at `pointer`; KeyError when there is none. An array's index is
    ASCII digits only ("²" is a digit to `str.isdigit`, not to `int`)."""
    node = document
    for raw in pointer.split("/")[1:]:
        token = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and (index := array_index(token)) < len(node):
            node = node[index]
        else:
            raise KeyError(pointer)
    return node


def array_index(token: str) -> int:
    """A pointer's token as an array index; past any array's end when it is none."""
    return int(token) if token.isascii() and token.isdigit() else sys.maxsize


def source_document(value: bytes) -> Any:
    """A source record's JSON value; InvalidInput when it is not JSON, or nests deeper
    than a task can hold."""
    try:
        document = record_json(value)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"source record is not JSON: {exc}", code="source_not_json") from exc
    return shallow(document, value, source=True)


def _text(value: bytes | None) -> str | None:
    return value.decode(errors="replace") if value is not None else None


# How a raw key that is not UTF-8 reads as text (a task id, a template's `key`).
RAW_KEY_PREFIX = "base64:"


def base64_unless_utf8(value: Any) -> str | None:
    """Bytes that are not UTF-8, in base64: what a sink writes as read (a key, a header),
    where their text cannot say them. None for UTF-8 bytes (their text is them), or for
    what is no bytes (a registry's decoded key)."""
    if not isinstance(value, bytes):
        return None
    try:
        value.decode()
    except UnicodeDecodeError:
        return base64.b64encode(value).decode()
    return None


def raw_key_text(key: bytes) -> str:
    """A raw record key as text: the key itself when it is UTF-8, else `base64:` and its
    bytes in base64. Never two keys one text: decoded with replacement characters, keys
    such as Java's LongSerializer's (8 bytes, most not UTF-8) made many records one task."""
    raw = base64_unless_utf8(key)
    return key.decode() if raw is None else RAW_KEY_PREFIX + raw


def _key_text(key: bytes | Any) -> str:
    """A record key as a task id: raw bytes as text (`raw_key_text`), a decoded scalar as
    text, a decoded structure as its canonical JSON."""
    if key is None or key == b"":
        raise InvalidInput("source record has no key for its task_id", code="source_key")
    if isinstance(key, bytes):
        return raw_key_text(key)
    if isinstance(key, dict | list):
        return orjson.dumps(key, option=orjson.OPT_SORT_KEYS).decode()
    return str(key)


def _checked_id(task_id: str, what: str, code: str) -> str:
    """A mapped task id, or InvalidInput when it is empty or longer than the contract's
    task ids (the forward's key is the task id: a longer one would also break the room
    its topic's limit keeps for a key)."""
    if not task_id:
        raise InvalidInput(f"{what} is empty", code=code)
    if len(task_id) > TASK_ID_LIMIT:
        raise InvalidInput(f"{what} is {len(task_id)} characters long, over the "
                           f"{TASK_ID_LIMIT} a task id may take", code=code)  # fmt: skip
    return task_id


class SourceMapper:
    """One pipeline's mapping from a record of its source topics to a task."""

    def __init__(
        self,
        pipeline: str,
        spec: SourceSpec,
        sink: SinkSpec | None = None,
        session: Sessions | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.spec = spec
        # Where the pipeline's tasks say their session (its versions' `session:`): a turn
        # goes to its session's partition, in the order of its source's.
        self.session = session
        # The pipeline's sink needs the record itself (its value, key or headers): kept in
        # the task as `source_record` (its position is the ingest's to add).
        self.sink = sink if sink is not None and sink.keeps_source_record else None
        try:
            self._filter = ENV.compile_expression(spec.filter) if spec.filter else None
            how = spec.task_id
            templated = isinstance(how, str) and how != "key" and not how.startswith("/")
            self._id_template = ENV.from_string(str(how)) if templated else None
            self._slots = {
                name: expr if expr.startswith("/") else ENV.from_string(expr)
                for name, expr in spec.slots.items()
            }
            erase = spec.erase
            self._erase_when = ENV.compile_expression(erase.when) if erase else None
            self._erase_id = ENV.from_string(erase.task_id) if erase and erase.task_id else None
            self._erase_session = (
                ENV.from_string(erase.session_id) if erase and erase.session_id else None
            )
        except TemplateError as exc:
            raise ConfigError(f"pipeline {pipeline}: source: {exc}") from exc

    def task(
        self,
        value: bytes | None,
        key: bytes | None,
        headers: Headers | None = None,
        timestamp: float | None = None,
    ) -> dict[str, Any] | Skipped | Erase:
        """The task (record contract v1) a record maps to, why it is skipped, or the task
        it deletes. Raises InvalidInput when it cannot be mapped."""
        if value is None:
            if self._erase_when is None:
                return Skipped("tombstone")
            return self.map(None, key, headers, timestamp)
        return self.map(source_document(value), key, headers, timestamp)

    def map(
        self,
        document: Any,
        key: bytes | Any,
        headers: Headers | None = None,
        timestamp: float | None = None,
    ) -> dict[str, Any] | Skipped | Erase:
        """The task a decoded record maps to (`task` after its JSON parse; the sources'
        ingest after a registry decode), or the task it deletes. `key`: the raw key, or
        the decoded one; `document` None: a tombstone."""
        scope = {
            "value": document,
            "key": raw_key_text(key) if isinstance(key, bytes) else key,
            # A header's value may be null (Kafka allows it; aiokafka gives None): null here.
            "headers": {k: _text(v) for k, v in headers or ()},
            "timestamp": timestamp,
        }
        if self._erase_when is not None:
            with over_record("source erase.when", "source_erase"):
                deletes = bool(self._erase_when(**scope))
            if deletes:
                session = None
                if self._erase_session is not None:
                    with over_record("source erase.session_id", "source_erase"):
                        session = self._erase_session.render(**scope).strip() or None
                return Erase(self._erased_id(document, key, scope), scope["key"], session,
                             base64_unless_utf8(key))  # fmt: skip
            if document is None:
                return Skipped("tombstone")
        if self._filter is not None:
            with over_record("source filter", "source_filter"):
                wanted = bool(self._filter(**scope))
            if not wanted:
                return Skipped("filter")
        slots = {name: self._slot(name, how, document, scope) for name, how in self._slots.items()}
        task: dict[str, Any] = {
            "task_id": self._task_id(document, key, scope),
            "pipeline": self.pipeline,
            "input": slots,
        }
        if self.spec.prompt_version:
            task["prompt_version"] = self.spec.prompt_version
        if self.sink is not None:
            task["source_record"] = self._kept(self.sink, document, key, headers, scope)
        return task

    @staticmethod
    def _kept(
        sink: SinkSpec, document: Any, key: bytes | Any, headers: Headers | None,
        scope: dict[str, Any],
    ) -> dict[str, Any]:  # fmt: skip
        """The source record as the task keeps it for the sink (its position is the
        ingest's to add)."""
        kept = set(sink.headers)
        record = {
            "key": jsonable(scope["key"]),
            "value": jsonable(document),
            "headers": {k: v for k, v in scope["headers"].items() if k in kept},
        }
        # Bytes their text cannot say, only when there are some: older readers lack them.
        if (raw := base64_unless_utf8(key)) is not None:
            record["key_base64"] = raw
        binary = {k: b for k, v in dict(headers or ()).items()  # the last, as `headers`
                  if k in kept and (b := base64_unless_utf8(v)) is not None}  # fmt: skip
        if binary:
            record["headers_base64"] = binary
        return record

    def _erased_id(self, document: Any, key: bytes | Any, scope: dict[str, Any]) -> str:
        """The id of the task a delete deletes: by `erase.task_id`, else the source's rule."""
        if self._erase_id is None:
            return self._task_id(document, key, scope)
        with over_record("source erase.task_id", "source_erase"):
            task_id = self._erase_id.render(**scope).strip()
        return _checked_id(task_id, "source erase.task_id", "source_erase")

    def _task_id(self, document: Any, key: bytes | Any, scope: dict[str, Any]) -> str:
        how = self.spec.task_id
        if self._id_template is not None:
            with over_record("source task_id", "source_task_id"):
                task_id = self._id_template.render(**scope).strip()
            return _checked_id(task_id, "source task_id", "source_task_id")
        if how == "key":
            return _checked_id(_key_text(key), "source record's key", "source_key")
        pointers = how if isinstance(how, list) else [how]
        values = [self._pointed(document, p, "task_id") for p in pointers]
        if isinstance(how, str):
            if not isinstance(values[0], str | int) or isinstance(values[0], bool):
                raise InvalidInput(f"task_id at {how} is not a string or an integer",
                                   code="source_task_id")  # fmt: skip
            task_id = str(values[0])
        else:
            digest = hashlib.sha256(orjson.dumps(values, option=orjson.OPT_SORT_KEYS))
            task_id = f"{self.pipeline}-{digest.hexdigest()[:32]}"
        return _checked_id(task_id, "source task_id", "source_task_id")

    def _slot(self, name: str, how: Any, document: Any, scope: dict[str, Any]) -> Any:
        if isinstance(how, str):
            return self._pointed(document, how, f"slot {name}")
        with over_record(f"source slot {name}", "source_slot"):
            return how.render(**scope)

    @staticmethod
    def _pointed(document: Any, pointer: str, what: str) -> Any:
        try:
            return pointer_get(document, pointer)
        except KeyError:
            raise InvalidInput(f"source record has nothing at {pointer} for its {what}",
                               code="source_pointer") from None  # fmt: skip


__all__ = [
    "Skipped",
    "SourceMapper",
    "SourceSpec",
    "array_index",
    "base64_unless_utf8",
    "pointer_get",
    "raw_key_text",
    "source_document",
]
