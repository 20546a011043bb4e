"""The Python API on the simulator: a task in, its result or dead letter out; the shipped
Faust example builds."""

from __future__ import annotations

import asyncio
import importlib.util
import shutil
from pathlib import Path
from typing import Any

import faust
import orjson
import pytest
import yaml

from streams.api import Analyzer, SessionTurns
from streams.contract.records import result_key
from streams.core.outcome import Outcome
from streams.dev.simulator import SimulatorServer
from streams.pipelines.sources import Skipped
from streams.settings import Settings, load_settings
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


async def test_a_task_that_is_not_json_is_a_dead_letter_not_an_exception(
    simulator: SimulatorServer,
) -> None:
    """A mapping orjson cannot write (an integer past 64 bits, a set, a key that is not a
    string) comes back as the task's dead letter, as a record that is not JSON does."""
    settings = load_settings(llm={"base_url": simulator.base_url, "api_key": "k",
                                  "model": "sim-1"})  # fmt: skip
    inputs: list[Any] = [{"text": "x", "order": 2**70}, {"text": {"a", "b"}}, {1: "x"}]
    async with Analyzer(settings) as analyzer:
        letters = [await analyzer.analyze({"task_id": f"j-{n}", "pipeline": "comment-analysis",
                                           "input": given})
                   for n, given in enumerate(inputs)]  # fmt: skip
        keyed = await analyzer.analyze({"task_id": 7, "input": {1: 2}}, key=b"k-7")
    for n, letter in enumerate(letters):
        record = letter.record()
        assert (letter.kind, letter.key, record["task_id"]) == ("dead_letter", f"j-{n}", f"j-{n}")
        assert record["error"]["category"] == "invalid_input"
        assert record["error"]["code"] == "not_json"
        assert "not JSON" in record["error"]["message"]
    assert (keyed.kind, keyed.key) == ("dead_letter", "k-7")  # no usable task id: its key
    assert simulator.sim.snapshot()["requests"] == 0


@pytest.fixture
def session_settings(simulator: SimulatorServer, tmp_path: Path) -> Settings:
    """comment-analysis whose version keeps sessions (the earlier turns' text and label)."""
    data = yaml.safe_load((ROOT / "pipelines" / "comment-analysis.yaml").read_text())
    data["versions"]["v1"]["session"] = {"budget_tokens": 2000,
                                         "keep": {"slots": ["text"], "fields": ["sentiment"]}}  # fmt: skip
    data.pop("chunking", None)
    directory = tmp_path / "pipelines"
    directory.mkdir()
    (directory / "comment-analysis.yaml").write_text(yaml.safe_dump(data, allow_unicode=True))
    return load_settings(llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1"},
                         pipelines_dir=directory, schemas_dir=ROOT / "schemas")  # fmt: skip


def earlier_users(messages: list[dict[str, str]]) -> list[str]:
    """The user messages a request carried before its own (the session's earlier turns)."""
    return [str(m["content"]) for m in messages if m["role"] == "user"][:-1]


async def test_the_analyzer_gives_a_session_turn_its_earlier_turns(
    simulator: SimulatorServer, session_settings: Settings
) -> None:
    def turn(session: str, i: int) -> dict[str, Any]:
        return {"task_id": f"{session}-{i}", "pipeline": "comment-analysis",
                "session_id": session, "input": {"text": f"Turn {i} of {session}: it broke."}}  # fmt: skip

    async with Analyzer(session_settings) as analyzer:
        # Asked together, a session's turns still run one after another, in order.
        first = await asyncio.gather(*(analyzer.analyze(turn("s-1", i)) for i in range(3)))
        alone = await analyzer.analyze(turn("s-2", 0))
        unrelated = await analyzer.analyze({"task_id": "u-1", "pipeline": "comment-analysis",
                                            "input": {"text": "Turn 0 of s-1: it broke."}})  # fmt: skip
        assert analyzer.sessions.busy == set()  # no lock left behind
    assert all(o.kind == "result" for o in [*first, alone, unrelated])
    asked = [earlier_users(m) for m in simulator.sim.chats]
    assert asked[:3] == [[], ["Turn 0 of s-1: it broke."],
                         ["Turn 0 of s-1: it broke.", "Turn 1 of s-1: it broke."]]  # fmt: skip
    assert asked[3:] == [[], []]  # another session's first turn, a task of no session
    # A turn with history is another answer: its key is not the one without.
    second = turn("s-1", 1)
    without = result_key("comment-analysis", "v1", "s-1-1", second["input"], None)
    assert first[1].record()["prompt_version"] == "v1" and first[1].key != without
    assert first[0].key == result_key(
        "comment-analysis", "v1", "s-1-0", turn("s-1", 0)["input"], None
    )


async def test_the_analyzers_sessions_are_bounded(
    simulator: SimulatorServer, session_settings: Settings
) -> None:
    sessions = SessionTurns(max_sessions=1)
    async with Analyzer(session_settings, sessions=sessions) as analyzer:
        for session, i in [("s-1", 0), ("s-2", 0), ("s-1", 1), ("s-1", 2)]:
            await analyzer.analyze({"task_id": f"{session}-{i}", "pipeline": "comment-analysis",
                                    "session_id": session, "input": {"text": f"{session} {i}"}})  # fmt: skip
        # A turn that ends as a dead letter (no text) adds nothing to its session.
        bad = await analyzer.analyze({"task_id": "s-1-3", "pipeline": "comment-analysis",
                                      "session_id": "s-1", "input": {}})  # fmt: skip
    assert bad.kind == "dead_letter" and bad.record()["error"]["category"] == "invalid_input"
    asked = [earlier_users(m) for m in simulator.sim.chats]
    # s-2 pushed s-1 out: its second turn starts again; its third has the second.
    assert asked == [[], [], [], ["s-1 1"]]
    assert sessions.kept == ["s-1"]
    stored = sessions.get("s-1")
    assert stored is not None
    assert [t["task_id"] for t in orjson.loads(stored)["turns"]] == ["s-1-1", "s-1-2"]
    # Bounded by bytes too: two sessions' turns do not fit in one and a half's bytes.
    small = SessionTurns(max_bytes=len(stored) * 3 // 2)
    small.put("a", stored)
    small.put("b", stored)
    assert small.kept == ["b"] and small.kept_bytes == len(stored)
    small.put("b", b"{}")  # a session's turns written again: counted once
    assert small.kept_bytes == 2


async def test_a_session_turn_cancelled_while_it_waits_leaves_no_lock_behind() -> None:
    sessions = SessionTurns()
    entered, release = asyncio.Event(), asyncio.Event()

    async def first() -> None:
        async with sessions.turn("s"):
            entered.set()
            await release.wait()

    async def second() -> None:
        async with sessions.turn("s"):
            raise AssertionError("ran while the first turn held the session")

    running = asyncio.create_task(first())
    await entered.wait()
    waiting = asyncio.create_task(second())
    await asyncio.sleep(0)  # it waits for the session now
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert sessions.busy == {"s"}  # the first turn still holds it
    release.set()
    await running
    assert sessions.busy == set()
    async with sessions.turn("s"):  # and the session can be taken again
        pass


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
