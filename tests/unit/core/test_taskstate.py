"""Task state records: history, forward compatibility, which record wrote, size."""

from __future__ import annotations

import orjson

from streams.contract.records import Source
from streams.core.taskstate import HISTORY_LIMIT, Status, TaskState
from streams.store.taskstore import Kind, readable


def test_state_round_trips_and_keeps_a_bounded_history() -> None:
    state = TaskState(task_id="t1", status=Status.RECEIVED, updated_at="")
    for i in range(HISTORY_LIMIT + 5):
        state = state.moved(
            Status.SUCCEEDED, prompt_version=f"v{i}", result_key=f"rk1-{i}",
            source=Source(topic="t", partition=0, offset=i),
        )  # fmt: skip
    assert state.status is Status.SUCCEEDED and state.prompt_version == f"v{HISTORY_LIMIT + 4}"
    assert len(state.history) == HISTORY_LIMIT
    assert state.history[-1].result_key == f"rk1-{HISTORY_LIMIT + 4}"
    assert TaskState.loads(state.dumps()) == state
    # A dead letter's move has no result key; it round-trips too.
    failed = state.moved(Status.DEAD_LETTERED, result_key=None, last_error={"category": "timeout"})
    assert TaskState.loads(failed.dumps()) == failed


def test_a_state_written_by_a_newer_version_is_read_with_its_extra_fields_ignored() -> None:
    """Rolling upgrade: a newer worker wrote fields this one does not know."""
    newer = orjson.dumps({
        "task_id": "t1", "status": "succeeded", "updated_at": "2026-01-01T00:00:00Z",
        "result_key": "rk1-x", "session": {"id": "s1"},
        "source": {"topic": "t", "partition": 0, "offset": 4, "leader_epoch": 3},
        "history": [{"status": "succeeded", "at": "x", "cost_usd": 0.1,
                     "source": {"topic": "t", "partition": 0, "offset": 4, "epoch": 1}}],
    })  # fmt: skip
    assert readable(Kind.TASK_STATES, newer)
    state = TaskState.loads(newer)
    assert state.result_key == "rk1-x" and state.wrote(Source(topic="t", partition=0, offset=4))


def test_a_record_wrote_its_outcome_when_its_move_is_in_the_history() -> None:
    """Two records of one task can each have written before their offsets committed;
    the check is per record, not only the latest writer."""
    a, b = Source(topic="t", partition=0, offset=1), Source(topic="t", partition=0, offset=2)
    state = TaskState(task_id="t1", status=Status.RECEIVED, updated_at="")
    state = state.moved(Status.SUCCEEDED, source=a).moved(Status.SUCCEEDED, source=b)
    assert state.wrote(a) and state.wrote(b)
    assert not state.wrote(Source(topic="t", partition=0, offset=3))
    assert not state.moved(Status.PROCESSING, source=Source(topic="t", partition=0, offset=3)
                           ).wrote(Source(topic="t", partition=0, offset=3))  # fmt: skip


def test_a_state_too_large_for_its_topic_drops_what_can_be_asked_again() -> None:
    state = TaskState(task_id="t1", status=Status.RECEIVED, updated_at="")
    for i in range(HISTORY_LIMIT):
        state = state.moved(Status.DEAD_LETTERED, source=Source(topic="t", partition=0, offset=i))
    state = state.model_copy(update={
        "stage_outputs": {"main": {"summary": "s" * 50_000}},
        "last_error": {"category": "timeout", "message": "m" * 20_000},
    })  # fmt: skip
    assert len(state.dumps()) > 70_000
    assert TaskState.loads(state.dumps_within(100_000)) == state  # fits: kept whole
    cut = TaskState.loads(state.dumps_within(10_000))
    assert cut.stage_outputs is None and cut.task_id == "t1" and len(cut.history) <= 1
    assert len(state.dumps_within(10_000)) <= 10_000


def test_a_task_ended_for_a_source_record_is_known_by_it_under_its_key_or_version() -> None:
    """A source record forwarded twice is one task: its result under that result key, or
    its dead letter under that version, was written for it (another key or version: a
    task of its own to answer)."""
    src = Source(topic="llm-tasks", partition=1, offset=4)
    state = TaskState(task_id="t1", status=Status.RECEIVED, updated_at="").moved(
        Status.SUCCEEDED, origin="shop.reviews/0/17", prompt_version="v1", result_key="rk1-a",
        source=src,
    )  # fmt: skip
    state = TaskState.loads(state.dumps())  # as the store keeps it
    assert state.came_from("shop.reviews/0/17", "rk1-a", "v1")
    assert not state.came_from("shop.reviews/0/17", "rk1-b", "v2")  # a new version's key
    assert not state.came_from("shop.reviews/0/18", "rk1-a", "v1")  # another source record
    failed = state.moved(Status.DEAD_LETTERED, origin="shop.reviews/0/30", prompt_version="v2",
                         result_key=None, source=src)  # fmt: skip
    assert failed.came_from("shop.reviews/0/30", "rk1-c", "v2")
    assert not failed.came_from("shop.reviews/0/30", "rk1-c", "v3")


def test_a_task_ended_by_a_copy_a_command_run_sent_is_known_by_that_run() -> None:
    """A replay's or a backtrack's record ended the task (a result or a dead letter):
    another copy of it is known; a move still under way is not an end; an older worker's
    stored state (no `run`) knows none."""
    src = Source(topic="llm-tasks-replay", partition=1, offset=4)
    state = TaskState(task_id="t1", status=Status.RECEIVED, updated_at="")
    under_way = state.moved(Status.PROCESSING, run="rp-1@llm-tasks/1/9", source=src)
    assert not under_way.ran("rp-1@llm-tasks/1/9")
    ended = TaskState.loads(under_way.moved(Status.DEAD_LETTERED, run="rp-1@llm-tasks/1/9",
                                            source=src).dumps())  # fmt: skip
    assert ended.ran("rp-1@llm-tasks/1/9")
    assert not ended.ran("rp-1@llm-tasks/1/10") and not ended.ran("rp-2@llm-tasks/1/9")
    older = orjson.loads(ended.dumps())
    for entry in older["history"]:
        entry.pop("run", None)
    assert not TaskState.model_validate(older).ran("rp-1@llm-tasks/1/9")
