"""What the store's retention means for the decisions: an expired dead letter does not
make a record's dead letter written twice (its task state says it was); a task whose
result and state expired is answered again, under the same result key."""

from __future__ import annotations

from dataclasses import replace

import orjson
import pytest

from streams.contract.lanes import Lane
from streams.contract.records import Source
from streams.core.cache import ContentCache
from streams.core.decide import Asked, Decider
from streams.core.outcome import Outcome, Prepared
from streams.core.taskstate import TaskState
from streams.errors import BadRequest, Category, StreamsError
from streams.llm.client import LLMRequest, LLMResponse
from streams.observability.metrics import Metrics
from tests.conftest import MakeProcessor
from tests.fakes import FakeLLM, answer

GOOD = {"sentiment": "positive", "confidence": 0.9, "topics": ["quality"], "issues": [],
        "summary": "good", "language": "en"}  # fmt: skip
RAW = orjson.dumps({"task_id": "t1", "pipeline": "comment-analysis",
                    "input": {"text": "Great phone."}})  # fmt: skip


class Store:
    """The task store as the decisions read it: plain dicts (entries may expire)."""

    def __init__(self) -> None:
        self.results: dict[str, bytes] = {}
        self.dead_letters: dict[str, bytes] = {}
        self.states: dict[str, TaskState] = {}

    def result(self, partition: int, result_key: str) -> bytes | None:
        return self.results.get(result_key)

    def dead_letter(self, partition: int, key: str) -> bytes | None:
        return self.dead_letters.get(key)

    def state(self, partition: int, task_id: str) -> TaskState | None:
        return self.states.get(task_id)

    def wrote(self, outcome: Outcome, state: TaskState) -> None:
        target = self.results if outcome.kind == "result" else self.dead_letters
        target[outcome.key] = outcome.value
        self.states[state.task_id] = state


def prepared(processor: object, offset: int) -> Prepared:
    prep = processor.intake.prepare(RAW, b"t1", Source(topic="tasks", partition=0, offset=offset))  # type: ignore[attr-defined]
    assert isinstance(prep, Prepared)
    return prep


async def test_a_dead_letter_expired_from_the_store_is_not_written_again_by_its_record(
    make_processor: MakeProcessor,
) -> None:
    def refuse(_: object) -> object:
        raise StreamsError("refused", category=Category.CONTENT_FILTER, code="content_filter")

    llm = FakeLLM(refuse)  # type: ignore[arg-type]
    processor = make_processor(llm)
    store = Store()
    decider = Decider(processor, store, ContentCache(), Metrics(), "results")
    prep = prepared(processor, 7)
    first = await decider.decide(prep, Lane.LIVE, Asked())
    assert first.outcome is not None and first.outcome.kind == "dead_letter"
    store.wrote(first.outcome, decider.state_after(first.outcome, prep))
    calls = len(llm.requests)

    store.dead_letters.clear()  # past the dead letters' retention
    again = await decider.decide(prepared(processor, 7), Lane.LIVE, Asked())  # a crash re-run
    assert again.kind == "already_done" and again.outcome is None
    assert len(llm.requests) == calls


async def test_a_task_whose_result_and_state_expired_is_answered_again_under_its_key(
    make_processor: MakeProcessor,
) -> None:
    llm = FakeLLM(lambda _r: answer(GOOD))
    processor = make_processor(llm)
    store = Store()
    decider = Decider(processor, store, ContentCache(), Metrics(), "results")
    prep = prepared(processor, 7)
    first = await decider.decide(prep, Lane.LIVE, Asked())
    assert first.outcome is not None and first.outcome.kind == "result"
    store.wrote(first.outcome, decider.state_after(first.outcome, prep))

    later = prepared(processor, 90)  # a new record of the task
    cached = await decider.decide(later, Lane.LIVE, Asked())
    assert cached.outcome is not None and cached.outcome.attempts == 0  # from the store
    assert len(llm.requests) == 1

    store.results.clear()
    store.states.clear()  # both past their retention
    decider.cache = ContentCache()  # and out of the worker's memory (a restart)
    fresh = await decider.decide(prepared(processor, 91), Lane.LIVE, Asked())
    assert fresh.outcome is not None and fresh.outcome.kind == "result"
    assert len(llm.requests) == 2  # asked again
    assert fresh.outcome.key == first.outcome.key  # the same result key


async def test_an_answer_a_version_made_before_it_was_edited_is_kept_said_and_counted(
    make_processor: MakeProcessor,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A user edits v1's prompt in place and replays last month: every replayed task was
    handed its stored answer, silently — the history looked re-analysed and was not.
    The answer is still handed out (a task is answered once), under the digest it was
    made with, and the edit is said once with the way round it, and counted; a forced
    replay asks the model and writes the definition of now."""
    llm = FakeLLM(lambda _r: answer(GOOD))
    processor = make_processor(llm)
    store, metrics = Store(), Metrics()
    decider = Decider(processor, store, ContentCache(), metrics, "results")
    prep = prepared(processor, 7)
    then = prep.version.digest
    first = await decider.decide(prep, Lane.LIVE, Asked())
    assert first.outcome is not None and first.outcome.record()["prompt_digest"] == then
    store.wrote(first.outcome, decider.state_after(first.outcome, prep))

    # The file edited, the worker restarted: the version's definition is another.
    monkeypatch.setitem(prep.version.__dict__, "digest", "0123456789abcdef")
    decider.cache = ContentCache()
    for offset in (90, 91):  # two replayed records of the task
        again = await decider.decide(prepared(processor, offset), Lane.LIVE, Asked())
        assert again.outcome is not None and again.outcome.record()["prompt_digest"] == then
    assert len(llm.requests) == 1
    said = [r for r in caplog.records if "was changed since task t1 was answered" in r.message]
    assert len(said) == 1 and "--force" in said[0].message
    assert metrics.stale_answers.labels("comment-analysis", "v1")._value.get() == 2
    forced = await decider.decide(prepared(processor, 92), Lane.LIVE, Asked(force=True))
    assert forced.outcome is not None and len(llm.requests) == 2
    assert forced.outcome.record()["prompt_digest"] == "0123456789abcdef"


async def test_stage_answers_kept_by_a_failed_run_are_used_again_only_under_their_definitions(
    make_processor: MakeProcessor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """comment-triage: the analysis, then a reply draft. The reply stage fails; the
    analysis is kept for the task's next run. Its prompt improved in place since, that next
    run used the old analysis all the same (the reply built on it, the result said to be
    of the new definition); now it is asked again. The reply's pipeline edited in place
    alone: the analysis is still used, the reply asked."""
    replies = {"fail": True}

    def behaviour(request: LLMRequest) -> LLMResponse:
        if "replies on behalf of" not in request.messages[0]["content"]:
            return answer({**GOOD, "sentiment": "negative"})
        if replies["fail"]:
            raise BadRequest("refused", code="bad_request")
        return answer({"reply": "Sorry.", "tone": "apologetic", "escalate": True})

    llm = FakeLLM(behaviour)
    processor = make_processor(llm)
    store = Store()
    decider = Decider(processor, store, ContentCache(), Metrics(), "results")
    raw = orjson.dumps({"task_id": "t1", "pipeline": "comment-triage",
                        "input": {"text": "Broke on day two."}})  # fmt: skip

    async def run(offset: int) -> Outcome:
        prep = processor.intake.prepare(raw, b"t1", Source(topic="tasks", partition=0,
                                                            offset=offset))  # fmt: skip
        assert isinstance(prep, Prepared)
        decided = await decider.decide(prep, Lane.LIVE, Asked())
        assert decided.outcome is not None
        store.wrote(decided.outcome, decider.state_after(decided.outcome, prep))
        return decided.outcome

    first = await run(7)
    assert first.kind == "dead_letter" and first.stage == "reply" and len(llm.requests) == 2
    kept = store.states["t1"]
    assert kept.stage_outputs is not None and set(kept.stage_outputs) == {"main"}

    pipeline = processor.registry.get("comment-triage")
    version = pipeline.version("v1")
    monkeypatch.setitem(version.__dict__, "own_digest", "0123456789abcdef")  # main edited
    second = await run(8)
    assert second.kind == "dead_letter" and len(llm.requests) == 4  # both asked again
    assert store.states["t1"].stage_digests == {"main": "0123456789abcdef"}

    replies["fail"] = False
    monkeypatch.setattr(pipeline, "stages", [replace(s, digest="fedcba9876543210")
                                             for s in pipeline.stages])  # fmt: skip
    third = await run(9)
    assert third.kind == "result" and len(llm.requests) == 5  # the reply alone
    assert third.record()["output"]["stages"]["reply"]["tone"] == "apologetic"
