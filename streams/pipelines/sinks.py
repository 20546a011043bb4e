"""A pipeline's `sink:`: its answers written again where its users read them — a topic
of their own, in the shape and under the key they want (`core.sinks` builds the
records). The envelope in the results topic stays written: it is the task store's
changelog and the contract's record; a sink is one more write of the same answer."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from streams.contract.mistakes import WRITTEN

Shape = Literal["envelope", "output", "enriched"]
SinkKey = Literal["task_id", "source_key", "result_key"]


class SinkSpec(BaseModel):
    model_config = WRITTEN

    topic: str = Field(min_length=1, max_length=249, description="The topic answers go to.")
    shape: Shape = Field(
        "enriched",
        description="envelope: the result record as in the results topic; output: the "
        "answer alone; enriched: the source record's value (a task published to llm-tasks: "
        "its input) with the answer and its provenance under `field`.",
    )
    key: SinkKey = Field(
        "task_id",
        description="The sink record's key: the task id, the source record's key (a task "
        "with no source record: its task id), or the result key.",
    )
    field: str = Field(
        "llm",
        min_length=1,
        description="enriched: the field the answer and its provenance (prompt version, "
        "model, result key, cost, processed_at) go under.",
    )
    fields: dict[str, str] = Field(
        default_factory=dict,
        description="enriched: top-level fields set from the answer by JSON pointer "
        "(`sentiment: /sentiment`); with them, `field` holds the provenance alone.",
    )
    format: Literal["json", "json_schema", "avro"] = Field(
        "json",
        description="json: the value as JSON; json_schema / avro: in the schema registry's "
        "wire format, under a schema derived from the pipeline's output schema, registered "
        "under `<topic>-value` at start (a change the subject's compatibility refuses stops "
        "the start, said); avro enriched: the source's own Avro schema (its registry "
        "subject's latest, read at start) with the answer's fields added.",
    )
    headers: list[str] = Field(
        default_factory=list,
        description="Headers of the source record carried over to the sink record, by "
        "name (a task published to llm-tasks has none to carry).",
    )
    dead_letters: str | None = Field(
        None,
        min_length=1,
        max_length=249,
        description="A topic for a copy of the pipeline's dead letters (the dead-letter "
        "topic keeps them all); none: no copy.",
    )

    @model_validator(mode="after")
    def _shape_options(self) -> SinkSpec:
        if self.shape != "enriched" and (self.fields or self.field != "llm"):
            raise ValueError("sink: `field` and `fields` are for the enriched shape")
        bad = sorted(name for name, p in self.fields.items() if not p.startswith("/"))
        if bad:
            raise ValueError(f"sink.fields {bad}: each must name a JSON pointer (`/path`)")
        if self.fields and self.field in self.fields:
            raise ValueError(f"sink.fields sets {self.field!r}, the provenance's field")
        if self.dead_letters == self.topic:
            raise ValueError("sink.dead_letters must be another topic than sink.topic")
        return self

    @property
    def keeps_source_record(self) -> bool:
        """Does a task need its source record for this sink?"""
        return self.shape == "enriched" or self.key == "source_key" or bool(self.headers)


__all__ = ["Shape", "SinkKey", "SinkSpec"]
