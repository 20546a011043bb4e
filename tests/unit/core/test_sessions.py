"""Session context: the turns a session keeps, the earlier turns a prompt gets (trimmed to
the budget by priority), the keys they change, and a conversation's one version."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from streams.contract.records import BOM, Source, result_key
from streams.core.outcome import Prepared
from streams.core.sessions import add_turn, context_of, has_turn, messages_of, turn_of
from streams.pipelines.registry import PipelineRegistry
from streams.pipelines.specs import SessionSpec
from tests.conftest import MakeProcessor
from tests.fakes import FakeLLM

ROOT = Path(__file__).resolve().parents[3]


def words(messages: list[dict[str, str]]) -> int:
    """A token count for the tests: words."""
    return sum(len(m["content"].split()) for m in messages)


def stored(*turns: dict[str, Any], spec: SessionSpec) -> bytes:
    value: bytes | None = None
    for turn in turns:
        value = add_turn(value, turn, spec)
    assert value is not None
    return value


def turn(n: int, spec: SessionSpec, *, intent: str = "", text: str = "") -> dict[str, Any]:
    said = text or f"turn {n} says something"
    return turn_of(f"t{n}", n * 10, {"text": said, "rating": None},
                   {"summary": f"answer {n}", "intent": intent}, spec)  # fmt: skip


def test_a_turn_keeps_the_slots_and_fields_asked_for() -> None:
    spec = SessionSpec(keep={"slots": ["text"], "fields": ["summary"]})
    t = turn_of("t1", 5, {"text": "hi", "product": "cup"}, {"summary": "s", "sentiment": "x"},
                spec)  # fmt: skip
    assert t == {"task_id": "t1", "position": 5, "input": {"text": "hi"},
                 "output": {"summary": "s"}, "marked": False}  # fmt: skip
    assert messages_of(t) == [{"role": "user", "content": "hi"},
                              {"role": "assistant", "content": '{"summary":"s"}'}]  # fmt: skip


def test_turns_are_ordered_replaced_and_capped() -> None:
    spec = SessionSpec(max_turns=3)
    value = stored(turn(2, spec), turn(1, spec), turn(3, spec), spec=spec)
    value = add_turn(value, turn(2, spec, text="turn 2 answered again"), spec)
    turns = orjson.loads(value)["turns"]
    assert [t["task_id"] for t in turns] == ["t1", "t2", "t3"]
    assert turns[1]["input"]["text"] == "turn 2 answered again"
    value = add_turn(value, turn(4, spec), spec)
    assert [t["task_id"] for t in orjson.loads(value)["turns"]] == ["t2", "t3", "t4"]
    assert has_turn(value, "t4") and not has_turn(value, "t1")


def test_a_session_never_outgrows_what_its_topic_takes() -> None:
    spec = SessionSpec()
    big = [turn(n, spec, text=f"turn {n} " + "x" * 3000) for n in range(1, 6)]
    value = stored(*big, spec=spec)
    assert len(value) > 15_000  # no room given: all five kept
    room = 10_000
    capped: bytes | None = None
    for t in big:
        capped = add_turn(capped, t, spec, room)
        assert len(capped) <= room
    assert [t["task_id"] for t in orjson.loads(capped or b"")["turns"]] == ["t3", "t4", "t5"]
    # A turn larger than the room on its own: the session holds none, the write fits.
    assert orjson.loads(add_turn(capped, big[0], spec, 1_000)) == {"turns": []}


def test_the_context_is_trimmed_last_turn_first_then_marked_then_newest() -> None:
    spec = SessionSpec(budget_tokens=20)  # each turn: 4 + 3 words = 7
    value = stored(turn(1, spec, intent="refund"), turn(2, spec), turn(3, spec), turn(4, spec),
                   turn(5, spec), spec=spec)  # fmt: skip
    ctx = context_of(value, "t6", 60, spec, words)
    # The last turn (5), the marked one (1), then the newest other (4); 2 and 3 dropped.
    said = [m["content"] for m in ctx.messages if m["role"] == "user"]
    assert said == ["turn 1 says something", "turn 4 says something", "turn 5 says something"]
    assert ctx.turns == 3 and ctx.digest is not None
    # Only turns before the task's own position, never its own.
    early = context_of(value, "t3", 30, spec, words)
    assert [m["content"] for m in early.messages if m["role"] == "user"] == [
        "turn 1 says something", "turn 2 says something"]  # fmt: skip
    assert context_of(value, "t1", 10, spec, words).digest is None  # the first turn
    assert context_of(None, "t1", 10, spec, words).messages == []
    # A budget no turn fits: no context.
    assert context_of(value, "t6", 60, SessionSpec(budget_tokens=3), words).digest is None


def session_registry(tmp_path: Path) -> PipelineRegistry:
    """comment-analysis whose versions v1 and v2 keep sessions, split half and half."""
    data = yaml.safe_load((ROOT / "pipelines" / "comment-analysis.yaml").read_text())
    session = {"budget_tokens": 500, "keep": {"slots": ["text"], "fields": ["summary"]}}
    v1 = dict(data["versions"]["v1"], session=session)
    data["versions"] = {"v1": v1, "v2": dict(v1, system=v1["system"] + "Be brief.\n")}
    data["traffic"] = {"v1": 0.5, "v2": 0.5}
    data.pop("chunking", None)
    (tmp_path / "comment-analysis.yaml").write_text(yaml.safe_dump(data, allow_unicode=True))
    return PipelineRegistry.load(tmp_path, ROOT / "schemas")


def record(task_id: str, session: str, text: str) -> bytes:
    return orjson.dumps({"task_id": task_id, "pipeline": "comment-analysis",
                         "session_id": session, "input": {"text": text}})  # fmt: skip


def test_prepare_puts_the_earlier_turns_in_the_prompt_and_the_key(
    make_processor: MakeProcessor, tmp_path: Path
) -> None:
    registry = session_registry(tmp_path)
    processor = make_processor(FakeLLM(), registry=registry)
    spec = registry.get("comment-analysis").versions["v1"].spec.session
    assert spec is not None
    history = stored(turn_of("a", 3, {"text": "Where is my order?"}, {"summary": "asks"}, spec),
                     spec=spec)  # fmt: skip
    src = Source(topic="tasks", partition=0, offset=9)
    prep = processor.intake.prepare(record("b", "s-1", "It is late."), b"s-1", src,
                             history=lambda s: history if s == "s-1" else None)  # fmt: skip
    alone = processor.intake.prepare(record("b", "s-1", "It is late."), b"s-1", src)
    assert isinstance(prep, Prepared) and isinstance(alone, Prepared)
    roles = [m["role"] for m in prep.prompt.messages]
    assert roles == ["system", "user", "assistant", "user"]
    assert prep.prompt.messages[1]["content"] == "Where is my order?"
    assert prep.session == "s-1" and prep.position == 9 and prep.context.turns == 1
    # Another history, another answer: the keys cover the context.
    assert prep.result_key != alone.result_key and prep.content_key != alone.content_key
    assert alone.result_key == result_key("comment-analysis", alone.version.version, "b",
                                          {"text": "It is late."})  # fmt: skip
    # The record's own turn (or a later one) is never its context.
    again = processor.intake.prepare(record("a", "s-1", "Where is my order?"), b"s-1",
                              Source(topic="tasks", partition=0, offset=3),
                              history=lambda s: history)  # fmt: skip
    assert isinstance(again, Prepared) and again.context.turns == 0


def test_a_session_keeps_its_version_and_is_read_for_ordering(
    make_processor: MakeProcessor, tmp_path: Path
) -> None:
    processor = make_processor(FakeLLM(), registry=session_registry(tmp_path))
    src = Source(topic="tasks", partition=0, offset=1)
    for session in (f"s-{i}" for i in range(20)):
        versions = set()
        for n in range(5):
            prep = processor.intake.prepare(
                record(f"{session}-{n}", session, f"turn {n}"), None, src
            )
            assert isinstance(prep, Prepared)
            versions.add(prep.version.version)
        assert len(versions) == 1, session
    chosen = {processor.intake.prepare(record(f"x-{i}", f"s-{i}", "hi"), None, src).version.version  # type: ignore[union-attr]
              for i in range(20)}  # fmt: skip
    assert chosen == {"v1", "v2"}  # the split still splits, by session
    assert processor.intake.session_hint(record("t", "s-7", "hi")) == "s-7"
    assert processor.intake.session_hint(b"{oops") is None
    # A record after a UTF-8 byte order mark is read as its decoder reads it.
    assert processor.intake.session_hint(BOM + record("t", "s-7", "hi")) == "s-7"


def test_a_session_key_must_name_a_place() -> None:
    with pytest.raises(ValueError, match=r"session\.key"):
        SessionSpec(key="somewhere")
    spec = SessionSpec(key="metadata.thread")
    assert spec.session_of({"metadata": {"thread": "th-1"}}) == "th-1"
    assert spec.session_of({"metadata": None}) is None


def test_a_duplicate_of_an_earlier_turn_after_later_ones_gets_its_first_prompt_and_key(
    make_processor: MakeProcessor, tmp_path: Path
) -> None:
    """Turn `a` (offset 3) was answered, then `b` (offset 9); a duplicate of `a` arrives at
    offset 12 (a producer's retry, a replay). Before, its history was "everything before
    offset 12" — `b` included — so it got another prompt, another result key, a second
    call, and its turn moved after `b`. It gets its first answer's context and key."""
    registry = session_registry(tmp_path)
    processor = make_processor(FakeLLM(), registry=registry)
    spec = registry.get("comment-analysis").versions["v1"].spec.session
    assert spec is not None
    before_a = stored(turn_of("z", 1, {"text": "Hello."}, {"summary": "greets"}, spec), spec=spec)
    first = processor.intake.prepare(record("a", "s-1", "Where is my order?"), b"s-1",
                              Source(topic="tasks", partition=0, offset=3),
                              history=lambda s: before_a)  # fmt: skip
    assert isinstance(first, Prepared)
    history = add_turn(before_a, turn_of("a", 3, {"text": "Where is my order?"},
                                         {"summary": "asks"}, spec), spec)  # fmt: skip
    history = add_turn(history, turn_of("b", 9, {"text": "It is late."}, {"summary": "late"},
                                        spec), spec)  # fmt: skip
    again = processor.intake.prepare(record("a", "s-1", "Where is my order?"), b"s-1",
                              Source(topic="tasks", partition=0, offset=12),
                              history=lambda s: history)  # fmt: skip
    assert isinstance(again, Prepared)
    assert again.result_key == first.result_key and again.position == 3
    assert again.prompt.messages == first.prompt.messages  # `b` is not in its context


def test_turns_another_version_wrote_in_another_shape_leave_the_session_working() -> None:
    """A stored session is read by whatever version runs next: a turn whose position is
    no number or whose input is no object (a newer version's, a hand edit) sorts first
    and is quoted as it is; the session's next turn is prompted and stored, not an
    internal_error for every turn of it."""
    spec = SessionSpec()
    odd = [{"task_id": "t-old", "position": "late", "input": ["a", "list"], "output": {}},
           {"task_id": "t-null", "position": None, "input": {"text": "hi"}}]  # fmt: skip
    value = orjson.dumps({"turns": [*odd, turn(1, spec)]})
    context = context_of(value, "t2", 20, spec, words)
    assert context.turns == 3
    said = [m["content"] for m in context.messages if m["role"] == "user"]
    assert sorted(said[:2]) == ["['a', 'list']", "hi"] and said[2] == "turn 1 says something"
    value = add_turn(value, turn(2, spec), spec)
    assert [t["task_id"] for t in orjson.loads(value)["turns"]] == ["t-old", "t-null", "t1", "t2"]
