"""Hostile input on a real Kafka: whatever a record or an answer contains — and on
whichever partition of the task topic, two of them added after the store's topics were
made —, the worker stays up and every input ends as exactly one result or one dead letter
that says what was wrong, and every record it writes fits its topic."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from aiokafka import AIOKafkaProducer
from aiokafka.admin import NewPartitions, NewTopic

from streams.dev.simulator import SimulatorServer
from streams.kafka import clients
from streams.kafka.routing import partition_for
from streams.kafka.topics import ensure_topics, state_topic
from tests.integration.helpers import WorkerProcess, assert_one_outcome_each, collect

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
MB = 1024 * 1024
LONG_ANSWER = {
    "name": "long-answer",
    "default_version": "v1",
    "output_schema": "long-answer.output.schema.json",
    "versions": {"v1": {
        "model": "sim-long", "params": {"max_tokens": 1_500_000},
        "response_format": "json_schema",
        "slots": {"text": {"type": "string", "required": True}},
        "system": "Role: a writer. Task: write at length about the text. Constraints: JSON.",
        "template": "<comment>{{ text }}</comment>",
    }},
}  # fmt: skip
LONG_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["essay"],
               "properties": {"essay": {"type": "string"}}}  # fmt: skip


def _folders(tmp: Path) -> tuple[Path, Path]:
    pipelines, schemas = tmp / "pipelines", tmp / "schemas"
    shutil.copytree(ROOT / "pipelines", pipelines)
    shutil.copytree(ROOT / "schemas", schemas)
    (pipelines / "long-answer.yaml").write_text(yaml.safe_dump(LONG_ANSWER))
    (schemas / "long-answer.output.schema.json").write_bytes(orjson.dumps(LONG_SCHEMA))
    return pipelines, schemas


def _task(task_id: str, text: str, pipeline: str = "comment-analysis") -> bytes:
    return orjson.dumps({"task_id": task_id, "pipeline": pipeline, "input": {"text": text}})


async def test_hostile_records_and_answers_end_as_one_outcome_each(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    simulator.sim.config.models = ["sim-1", "sim-long"]
    simulator.sim.config.long_answer_models = ["sim-long"]
    simulator.sim.config.long_answer_chars = 2 * MB
    simulator.sim.config.context_window = 4_000_000
    pipelines, schemas = _folders(tmp_path)
    settings = make_settings(
        llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1",
             "context_window": 4_000_000},
        pipelines_dir=pipelines, schemas_dir=schemas,
    )  # fmt: skip
    n = settings.kafka.partitions
    admin = clients.admin(settings)
    await admin.start()
    try:  # the task topic takes records of up to 16 MB
        await admin.create_topics([NewTopic(settings.topics.tasks, n, 1,
                                            topic_configs={"max.message.bytes": str(16 * MB)})])  # fmt: skip
    finally:
        await admin.close()
    await ensure_topics(settings)
    admin = clients.admin(settings)
    await admin.start()
    try:  # two partitions added to the task topic after the store's topics were made
        await admin.create_partitions({settings.topics.tasks: NewPartitions(total_count=n + 2)})
    finally:
        await admin.close()

    # Already in the worker's own topics: a value that is not JSON where results live, and
    # a task state written by a newer version (fields this one does not know).
    home = partition_for("h-future", n)
    future_state = orjson.dumps({
        "task_id": "h-future", "status": "failed", "updated_at": "2026-11-30T00:00:00Z",
        "attempts": 1, "session": {"id": "s-1", "turns": 3},
        "history": [{"status": "failed", "at": "2026-11-30T00:00:00Z", "cost_usd": 0.01}],
    })  # fmt: skip
    records: list[tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]] = [
        (b"h-2mb", _task("h-2mb", "x" * (2 * MB)), []),
        (b"h-10mb", _task("h-10mb", "y" * (10 * MB)), []),
        (b"\xff\xfe-not-utf8", b"\xff\xfe{not json at all", []),
        (b"\xff\xfe-key", _task("h-badkey", "Fine blender, quiet."), []),
        (b"h-notjson", b"just some text", []),
        (
            b"h-headers",
            _task("h-headers", "Great kettle."),
            [(f"x-header-{i}", f"value {i}".encode()) for i in range(200)],
        ),
        (b"h-long", _task("h-long", "Tell me everything.", "long-answer"), []),
        (b"h-future", _task("h-future", "The lid broke on day one."), []),
        # 2 KB nested 300 deep: read by orjson, and written back by nothing (not even its
        # dead letter, before: the lane crashed on it after each restart).
        (
            b"h-deep",
            b'{"task_id": "h-deep", "pipeline": "comment-analysis", "input": '
            b'{"text": ' + b'{"x": ' * 300 + b"1" + b"}" * 300 + b"}}",
            [],
        ),
    ]
    # Keys other than the task id: some land on another partition than their task's.
    records += [(f"other-key-{i}".encode(), _task(f"h-rekey-{i}", f"Nice mug {i}."), [])
                for i in range(8)]  # fmt: skip
    records += [(f"h-ok-{i}".encode(), _task(f"h-ok-{i}", f"Works well {i}."), [])
                for i in range(20)]  # fmt: skip
    # On the added partitions, which hold no task's home: a task, and a record without one.
    extra = [(n, b"h-extra", _task("h-extra", "Sturdy chair.")), (n + 1, b"h-extra-bad", b"{")]
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap_servers,
                                max_request_size=16 * MB, acks="all")  # fmt: skip
    await producer.start()
    try:
        while len(await producer.partitions_for(settings.topics.tasks)) < n + 2:
            await producer.client.force_metadata_update()  # the added ones not seen yet
        await (await producer.send(state_topic(settings), key=b"h-future", value=future_state,
                                   partition=home))  # fmt: skip
        await (await producer.send(settings.topics.results, key=b"garbage",
                                   value=b"\x00 not json", partition=home))  # fmt: skip
        for key, value, headers in records:
            await (await producer.send(settings.topics.tasks, key=key, value=value,
                                       headers=headers))  # fmt: skip
        for partition, key, value in extra:
            await (await producer.send(settings.topics.tasks, key=key, value=value,
                                       partition=partition))  # fmt: skip
    finally:
        await producer.stop()

    task_ids = {orjson.loads(v)["task_id"] for _, v, _ in records
                if v is not None and v.startswith(b"{")}  # fmt: skip

    task_ids.add("h-extra")

    def everything_ended(got: Any) -> bool:
        ended = {r["task_id"] for r in got.results} | {d["task_id"] for d in got.dead_letters}
        return task_ids | {"h-notjson", "h-extra-bad", None} <= ended

    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        got = await collect(settings, set(), timeout_s=180, worker=worker,
                            until=everything_ended, settle_s=3)  # fmt: skip
        assert everything_ended(got), worker.log_tail()
        assert worker.alive(), worker.log_tail()
        scrape = await worker.scrape()
    finally:
        worker.stop()

    assert_one_outcome_each(got, task_ids | {"h-notjson", "h-extra-bad"})
    dead = {d["task_id"]: d for d in got.dead_letters}
    for big, size in (("h-2mb", 2 * MB), ("h-10mb", 10 * MB)):
        letter = dead[big]
        assert (letter["error"]["category"], letter["error"]["code"]) == ("invalid_input",
                                                                         "too_large")  # fmt: skip
        payload = letter["payload"]
        assert payload["truncated"] and payload["size"] > size and len(payload["head"]) > 1000
        assert len(orjson.dumps(letter)) < MB  # fits the dead-letter topic
    assert dead["h-long"]["error"]["category"] == "output_too_large"
    assert dead["h-notjson"]["error"]["code"] == "not_json"
    assert dead[None]["error"]["code"] == "not_json"
    assert dead[None]["payload"]["raw_base64"]
    assert dead["h-deep"]["error"]["code"] == "too_deep"
    assert dead["h-deep"]["payload"]["raw_base64"]  # the bytes, as it came
    answered = {r["task_id"]: r for r in got.results}
    assert {f"h-ok-{i}" for i in range(20)} | {"h-headers", "h-future", "h-badkey"} <= set(answered)
    for i in range(8):  # answered on the partition their task id maps to
        result = answered[f"h-rekey-{i}"]
        assert result["source"]["partition"] == partition_for(f"h-rekey-{i}", n)
    # The added partitions' records, at home among the store's n: every task's (the
    # producer's partitioner spread them over n + 2), and the two sent there.
    assert all(r["source"]["partition"] < n for r in got.results)
    assert answered["h-extra"]["source"]["partition"] == partition_for("h-extra", n)
    assert dead["h-extra-bad"]["error"]["code"] == "not_json"
    assert dead["h-extra-bad"]["source"]["partition"] == n + 1  # where it stood
    assert scrape.value("llm_streams_store_unreadable_records_total", map="results") >= 1
    assert scrape.value("llm_streams_misrouted_records_total") >= 8
    assert scrape.value("llm_streams_dead_letters_total", category="output_too_large") == 1
