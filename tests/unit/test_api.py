"""The Python API on the simulator: a task in, its result or dead letter out; the shipped
Faust example builds."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import faust
import orjson

from streams.api import Analyzer
from streams.core.outcome import Outcome
from streams.dev.simulator import SimulatorServer
from streams.pipelines.sources import Skipped
from streams.settings import load_settings
from tests.fakes import FakeRegistry
from tests.unit.test_schema_registry import avro_body, framed

KEY = {"type": "record", "name": "Key", "fields": [{"name": "id", "type": "int"}]}
ROW = {
    "type": "record",
    "name": "Row",
    "fields": [
        {"name": "id", "type": "int"},
        {"name": "body", "type": "string"},
        {"name": "product_name", "type": "string"},
        {"name": "stars", "type": "int"},
    ],
}
CHANGE = {"type": "record", "name": "Envelope", "fields": [
    {"name": "op", "type": "string"}, {"name": "after", "type": ["null", ROW]}]}  # fmt: skip

ROOT = Path(__file__).resolve().parents[2]


async def test_the_analyzer_answers_a_task_and_dead_letters_bad_input(
    simulator: SimulatorServer,
) -> None:
    settings = load_settings(llm={"base_url": simulator.base_url, "api_key": "k",
                                  "model": "sim-1"})  # fmt: skip
    task = {"task_id": "a-1", "pipeline": "comment-analysis",
            "input": {"text": "Broke after a week. Refund please."}}  # fmt: skip
    async with Analyzer(settings) as analyzer:
        first = await analyzer.analyze(task)
        again = await analyzer.analyze(task)
        bad = await analyzer.analyze(b'{"task_id": "a-2", "pipeline": "nope", "input": {}}')
    assert first.kind == "result" and first.record()["output"]["sentiment"] == "negative"
    assert (again.key, again.output) == (first.key, first.output)  # the same result key
    assert bad.kind == "dead_letter"
    assert bad.record()["error"]["category"] == "invalid_input"
    assert simulator.sim.snapshot()["requests"] == 2  # no call for the bad one


def test_the_faust_example_builds_its_agent_on_the_api() -> None:
    spec = importlib.util.spec_from_file_location("faust_example", ROOT / "examples" /
                                                  "faust_app.py")  # fmt: skip
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert isinstance(example.app, faust.App)
    assert isinstance(example.analyzer, Analyzer)
    assert [a.name for a in example.app.agents.values()] == ["faust_example.analyse"]
    assert len((ROOT / "examples" / "faust_app.py").read_text().splitlines()) <= 40


async def test_the_analyzer_answers_a_source_record_decoded_with_the_registry(
    simulator: SimulatorServer, fake_registry: FakeRegistry, tmp_path: Path
) -> None:
    for example in ("reviews-avro", "plain-comments"):
        shutil.copy(ROOT / "examples" / "sources" / f"{example}.yaml", tmp_path)
    fake_registry.schemas[1] = {"schema": orjson.dumps(KEY).decode()}
    fake_registry.schemas[2] = {"schema": orjson.dumps(CHANGE).decode()}
    settings = load_settings(llm={"base_url": simulator.base_url, "api_key": "k",
                                  "model": "sim-1"}, pipelines_dir=tmp_path,
                             schema_registry={"url": fake_registry.url})  # fmt: skip
    row = {"id": 42, "body": "The zip broke after two days.", "product_name": "Bag", "stars": 1}
    key = framed(1, avro_body(KEY, {"id": 42}))
    async with Analyzer(settings) as analyzer:
        answered = await analyzer.analyze_record(
            "reviews-avro", framed(2, avro_body(CHANGE, {"op": "c", "after": row})), key=key
        )
        deleted = await analyzer.analyze_record(
            "reviews-avro", framed(2, avro_body(CHANGE, {"op": "d", "after": None})), key=key
        )
        unknown = await analyzer.analyze_record("reviews-avro", framed(9, b"\x02"), key=key)
        plain = await analyzer.analyze_record("plain-comments", b'{"comment": {"text": "Nice"}}',
                                              key=b"c-1")  # fmt: skip
        same = await analyzer.analyze({"task_id": "review-42", "pipeline": "reviews-avro",
                                       "input": {"text": row["body"], "product": "Bag",
                                                 "rating": "1"}})  # fmt: skip
    assert isinstance(answered, Outcome) and answered.kind == "result"
    assert answered.record()["task_id"] == "review-42"
    assert (same.key, same.output) == (answered.key, answered.output)  # as a task, as a record
    assert deleted == Skipped("filter")
    assert isinstance(unknown, Outcome) and unknown.kind == "dead_letter"
    assert unknown.record()["error"]["code"] == "source_schema_unknown"
    assert isinstance(plain, Outcome) and plain.record()["task_id"] == "c-1"
