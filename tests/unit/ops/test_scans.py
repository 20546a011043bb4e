"""What the operator commands hold while they read a topic whole: the latest of what they
need, never the topic's records."""

from __future__ import annotations

import asyncio
import tracemalloc
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest

from streams.contract.records import result_key
from streams.kafka import scan as scan_module
from streams.kafka.routing import partition_for
from streams.kafka.scan import scan_latest
from streams.kafka.topics import state_topic
from streams.ops import ab
from streams.ops import backtrack as backtrack_module
from streams.ops import diff as diff_module
from streams.ops import drift as drift_module
from streams.ops import outcomes as outcomes_module
from streams.ops import redrive as redrive_module
from streams.ops import replay as replay_module
from streams.ops.backtrack import Selection, backtrack, backtrack_id, latest_states
from streams.ops.redrive import redrive, task_state
from streams.ops.replay import Answered
from streams.pipelines.registry import PipelineRegistry
from streams.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parents[3]


@dataclass
class Rec:
    topic: str
    key: bytes | None
    value: bytes | None
    partition: int = 0
    offset: int = 0


Topics = dict[str, Callable[[], Iterator[Rec]]]


@pytest.fixture
def settings() -> Settings:
    return load_settings()


def serving(monkeypatch: pytest.MonkeyPatch, topics: Topics, partitions: int = 4) -> Counter[str]:
    """`scan` reads each topic's records as its function makes them (of the partitions
    asked for; the topics have `partitions`), in batches of 100, none of them kept here.
    Returned: how many records each topic gave."""
    read: Counter[str] = Counter()

    async def scan(settings: Settings, topic: str, *args: Any, **kw: Any) -> AsyncIterator[list]:
        batch: list[Rec] = []
        only = kw.get("partitions")
        for rec in topics.get(topic, lambda: iter(()))():
            if only is not None and rec.partition not in only:
                continue
            read[topic] += 1
            batch.append(rec)
            if len(batch) == 100:
                yield batch
                batch = []
        if batch:
            yield batch

    async def partitions_of(settings: Settings, topic: str) -> list[int]:
        return list(range(partitions))

    monkeypatch.setattr(scan_module, "scan", scan)
    for reader in (ab, outcomes_module, drift_module, replay_module):  # reading every record
        monkeypatch.setattr(reader, "scan", scan)
    for lister in (ab, diff_module, redrive_module):
        monkeypatch.setattr(lister, "partitions_of", partitions_of)
    return read


def exact(value: bytes) -> bytes:
    """`value` copied to its own size: orjson's bytes keep up to ten times their room, as
    bytes a broker sends do not."""
    return bytes(memoryview(value))


def state(task_id: str, status: str = "answered", **more: Any) -> bytes:
    return exact(orjson.dumps({"task_id": task_id, "status": status, "pipeline": "p",
                         "history": [{"status": status, "at": "x" * 900}], **more}))  # fmt: skip


async def test_the_latest_per_key_is_kept_as_shaped_and_a_key_shaped_out_is_gone(
    monkeypatch: pytest.MonkeyPatch, settings: Settings
) -> None:
    def records() -> Iterator[Rec]:
        yield Rec("t", b"a", b'{"n": 1}')
        yield Rec("t", b"b", b'{"n": 2}')
        yield Rec("t", b"a", b'{"n": 3}')  # its latest: shaped out, the earlier with it
        yield Rec("t", b"c", b'{"n": 4}')
        yield Rec("t", b"c", None)  # a tombstone
        yield Rec("t", b"d", b"not json")
        yield Rec("t", None, b'{"n": 5}')

    serving(monkeypatch, {"t": records})
    assert await scan_latest(settings, "t") == {b"a": {"n": 3}, b"b": {"n": 2}}
    odd = await scan_latest(settings, "t", shape=lambda v: v if v["n"] % 2 == 0 else None)
    assert odd == {b"b": {"n": 2}}
    assert await scan_latest(settings, "t", keys={b"a", b"c"}) == {b"a": {"n": 3}}


async def test_a_tasks_status_holds_its_own_state_not_the_topics(
    monkeypatch: pytest.MonkeyPatch, settings: Settings
) -> None:
    topic = state_topic(settings)

    def states() -> Iterator[Rec]:
        for i in range(10_000):
            task_id = f"task-{i}"
            yield Rec(topic, task_id.encode(), state(task_id), partition_for(task_id, 4), i)
        yield Rec(topic, b"task-7", state("task-7", "dead_lettered"), partition_for("task-7", 4))
        # A task of a session: its state is on its session's partition.
        yield Rec(topic, b"turn-1", state("turn-1"), (partition_for("turn-1", 4) + 1) % 4)

    read = serving(monkeypatch, {topic: states})
    tracemalloc.start()
    try:
        found = await task_state(settings, "task-7")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert found is not None and found["status"] == "dead_lettered"
    # The 10,000 records, held, are past 10 MB.
    assert peak < 3_000_000, f"peak {peak:,} bytes"
    assert read[topic] < 4_000  # its partition alone: about a quarter of the records
    turn = await task_state(settings, "turn-1")  # not on its task id's partition: found
    assert turn is not None and turn["task_id"] == "turn-1"


def letter(task_id: str, category: str, payload_bytes: int = 10_000, **more: Any) -> bytes:
    return exact(orjson.dumps({
        **more,
        "task_id": task_id, "error": {"category": category, "code": "x", "message": "m"},
        "payload": {"task_id": task_id, "pipeline": "p", "input": {"text": "t" * payload_bytes}},
        "source": {"topic": "llm-tasks", "partition": 0, "offset": 1},
        "failed_at": "2026-12-06T00:00:00+00:00", "attempts": 1,
    }))  # fmt: skip


async def test_a_redrive_keeps_whole_only_the_letters_it_may_send_and_their_states(
    monkeypatch: pytest.MonkeyPatch, settings: Settings
) -> None:
    dead = settings.topics.dead_letters

    def letters() -> Iterator[Rec]:
        for i in range(3_000):  # 30 MB of letters of another category
            yield Rec(dead, f"r-{i}".encode(), letter(f"task-{i}", "invalid_input"))
        yield Rec(dead, b"r-a", letter("task-a", "rate_limited"))
        yield Rec(dead, b"r-b", letter("task-b", "rate_limited"))

    def states() -> Iterator[Rec]:
        for i in range(3_000):
            yield Rec(state_topic(settings), f"task-{i}".encode(), state(f"task-{i}"))
        source = {"topic": "llm-tasks", "partition": 0, "offset": 1}
        yield Rec(state_topic(settings), b"task-a", state("task-a", "dead_lettered", source=source))
        yield Rec(state_topic(settings), b"task-b", state("task-b", "answered", source=source))

    serving(monkeypatch, {dead: letters, state_topic(settings): states})
    tracemalloc.start()
    try:
        plan = await redrive(settings, {"rate_limited"}, None, dry_run=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [x["task_id"] for x in plan.requeue] == ["task-a"]
    assert (plan.skipped_category, plan.skipped_answered) == (3_000, 1)
    assert peak < 10_000_000, f"peak {peak:,} bytes"  # the letters held: past 30 MB


async def test_a_redriven_turn_of_a_session_goes_under_its_sessions_key(
    monkeypatch: pytest.MonkeyPatch, settings: Settings
) -> None:
    """A session's turn was sent again keyed by its task id: it landed on another partition
    than its session's, and the worker forwarded it there (a forward counted as a
    misrouted record, logged as one). It goes as the publisher sends it."""
    dead, states = settings.topics.dead_letters, state_topic(settings)
    source = {"topic": "llm-tasks", "partition": 0, "offset": 1}
    turn = orjson.loads(letter("turn-2", "timeout", 10))
    turn["payload"]["session_id"] = "chat-9"

    def letters() -> Iterator[Rec]:
        yield Rec(dead, b"turn-2", orjson.dumps(turn))
        yield Rec(dead, b"alone", letter("alone", "timeout", 10))

    def stored() -> Iterator[Rec]:
        for task_id in (b"turn-2", b"alone"):
            yield Rec(states, task_id, state(task_id.decode(), "dead_lettered", source=source))

    serving(monkeypatch, {dead: letters, states: stored})
    sent: dict[str, bytes] = {}

    class Producer:
        async def start(self) -> None: ...
        async def stop(self) -> None: ...

        async def send(self, topic: str, *, key: bytes, **_: Any) -> Any:
            sent[orjson.loads(_["value"])["task_id"]] = key
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done

    monkeypatch.setattr(redrive_module.clients, "producer", lambda *_a, **_k: Producer())
    plan = await redrive(settings, {"timeout"}, None, dry_run=False)
    assert plan.sent == 2 and sent == {"turn-2": b"chat-9", "alone": b"alone"}


async def test_a_backtrack_keeps_the_states_it_chose_and_a_named_task_is_not_missing(
    monkeypatch: pytest.MonkeyPatch, settings: Settings
) -> None:
    topic = state_topic(settings)

    def states() -> Iterator[Rec]:
        yield Rec(topic, b"t1", state("t1", pipeline="p"))
        yield Rec(topic, b"t2", state("t2", pipeline="q"))
        yield Rec(topic, b"t3", state("t3", pipeline="p"))
        yield Rec(topic, b"t3", state("t3", pipeline="q"))  # moved out of the selection

    serving(monkeypatch, {topic: states})
    chosen = await latest_states(settings, Selection(pipeline="p"))
    assert chosen == {"t1": {"task_id": "t1", "chosen": True}}  # what it needs, no history
    named = await latest_states(settings, Selection(task_ids=frozenset({"t2", "t9"}),
                                                    pipeline="p"))  # fmt: skip
    assert named == {"t2": {"task_id": "t2"}}  # there, not chosen: not missing


async def test_an_ab_report_holds_what_it_counts_not_the_dead_letters_payloads(
    monkeypatch: pytest.MonkeyPatch, settings: Settings
) -> None:
    def letters() -> Iterator[Rec]:
        for i in range(3_000):  # 30 MB of payloads
            yield Rec(settings.topics.dead_letters, f"r-{i}".encode(),
                      letter(f"t-{i}", "invalid_output", pipeline="p", prompt_version="v1",
                             cost_usd=0.001))  # fmt: skip

    def results() -> Iterator[Rec]:
        for i in range(1_000):  # answered since: the result counts
            yield Rec(settings.topics.results, f"k-{i}".encode(), orjson.dumps({
                "task_id": f"t-{i}", "pipeline": "p", "prompt_version": "v1",
                "output": {"label": "ok"}, "cost_usd": 0.002,
                "usage": {"prompt_tokens": 10, "completion_tokens": 5},
            }))  # fmt: skip

    serving(monkeypatch, {settings.topics.dead_letters: letters, settings.topics.results: results})
    tracemalloc.start()
    try:
        evidence = await ab.gather(settings, "p", {})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    v1 = evidence["v1"]
    assert (v1.cost.n, v1.cost.sy, len(v1.outputs)) == (3_000, 1_000, 0)
    assert v1.cost.sx == pytest.approx(2_000 * 0.001 + 1_000 * 0.002)
    assert v1.evaluation.n("rejected") == 2_000  # invalid_output
    assert peak < 10_000_000, f"peak {peak:,} bytes"  # the letters held: past 30 MB


async def test_a_backtrack_reads_and_sends_its_tasks_a_part_at_a_time_in_written_order(
    monkeypatch: pytest.MonkeyPatch, settings: Settings
) -> None:
    topic, n = state_topic(settings), 3_000
    where = {i: ("llm-tasks", i % 3, n - i) for i in range(n)}  # written last to first

    def states() -> Iterator[Rec]:
        for i in range(n):
            source = dict(zip(("topic", "partition", "offset"), where[i], strict=True))
            yield Rec(topic, f"t-{i}".encode(), state(f"t-{i}", source=source))
        yield Rec(topic, b"t-gone", state("t-gone"))  # no source: its record is not known

    records = {where[i]: exact(orjson.dumps({
        "task_id": f"t-{i}", "pipeline": "comment-analysis", "prompt_version": "v1" if i else "v0",
        "input": {"text": "t" * 4_000}})) for i in range(n)}  # fmt: skip
    asked: list[list[tuple[str, int, int]]] = []

    async def read_at(settings: Settings, sources: list[tuple[str, int, int]]) -> dict:
        asked.append(sources)
        return {source: records[source] for source in sources}

    serving(monkeypatch, {topic: states})
    monkeypatch.setattr(backtrack_module, "read_at", read_at)
    monkeypatch.setattr(backtrack_module, "READ_AT_ONCE", 200)
    registry = PipelineRegistry.load(ROOT / "pipelines", ROOT / "schemas")
    tracemalloc.start()
    try:
        plan = await backtrack(settings, registry, Selection(pipeline="p"), "rerun", None,
                               dry_run=True)  # fmt: skip
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # t-0 pinned to a version its pipeline no longer has: left, said, the rest counted.
    assert (plan.sent, plan.no_version, plan.no_source) == (n - 1, ["t-0"], ["t-gone"])
    assert "no prompt version 'v0'" in plan.version_refused
    assert [len(part) for part in asked] == [200] * 15
    flat = [source for part in asked for source in part]
    assert flat == sorted(where.values())  # the order they were written in, per partition
    # 3,000 tasks of 4 KB: 12 MB held at once, as the planned sends held them.
    assert peak < 6_000_000, f"peak {peak:,} bytes"


async def test_a_restore_sends_what_its_version_answered_by_key_or_by_history(
    monkeypatch: pytest.MonkeyPatch, settings: Settings
) -> None:
    topic = state_topic(settings)
    answered = [{"status": "succeeded", "prompt_version": "v1", "result_key": "k"}]

    def task(i: int) -> bytes:
        return orjson.dumps({"task_id": f"t-{i}", "pipeline": "comment-analysis",
                             "input": {"text": f"text {i}"}})  # fmt: skip

    def states() -> Iterator[Rec]:
        for i, history in ((0, []), (1, answered), (2, [])):
            source = {"topic": "llm-tasks", "partition": 0, "offset": i}
            yield Rec(topic, f"t-{i}".encode(), exact(orjson.dumps({
                "task_id": f"t-{i}", "pipeline": "comment-analysis", "source": source,
                "history": history})))  # fmt: skip

    async def read_at(settings: Settings, sources: list[tuple[str, int, int]]) -> dict:
        return {source: task(source[2]) for source in sources}

    async def read_answered(settings: Settings, pipeline: str | None, version: str) -> Answered:
        assert (pipeline, version) == ("comment-analysis", "v1")  # only those keys are held
        # t-0's v1 result is stored
        return Answered({result_key("comment-analysis", "v1", "t-0", {"text": "text 0"}).encode()})

    serving(monkeypatch, {topic: states})
    monkeypatch.setattr(backtrack_module, "read_at", read_at)
    monkeypatch.setattr(backtrack_module, "read_answered", read_answered)
    registry = PipelineRegistry.load(ROOT / "pipelines", ROOT / "schemas")
    plan = await backtrack(settings, registry, Selection(pipeline="comment-analysis"), "restore",
                           "v1", dry_run=True)  # fmt: skip
    assert (plan.sent, plan.no_result) == (2, ["t-2"])


async def test_a_backtrack_run_again_leaves_out_what_it_put_back_unless_it_moved_since(
    monkeypatch: pytest.MonkeyPatch, settings: Settings
) -> None:
    """Killed half-way and run again with the same arguments: a task whose latest move is
    this backtrack's success is left out (a re-run is paid once); one that moved since (a
    new record answered), moved last by another backtrack, or that this one left
    dead-lettered, is sent."""
    topic, selection = state_topic(settings), Selection(pipeline="comment-analysis")
    mine = backtrack_id(selection, "rerun", "v1")
    assert mine == backtrack_id(Selection(pipeline="comment-analysis"), "rerun", "v1")
    assert mine != backtrack_id(selection, "rerun", None)
    assert mine != backtrack_id(selection, "restore", "v1")
    by = {"t-0": [f"{mine}@llm-tasks/0/0"],  # put back by this very backtrack
          "t-1": [f"{mine}@llm-tasks/0/1", None],  # ... then a new record of it answered
          "t-2": ["bt-other@llm-tasks/0/2"],  # another backtrack
          "t-3": [],
          "t-4": [f"{mine}@llm-tasks/0/4!"]}  # this one, dead-lettered: tried again  # fmt: skip

    def states() -> Iterator[Rec]:
        for i, runs in enumerate(by.values()):
            source = {"topic": "llm-tasks", "partition": 0, "offset": i}
            history = [{"status": "dead_lettered" if r and r.endswith("!") else "succeeded",
                        **({"run": r.rstrip("!")} if r else {})} for r in runs]  # fmt: skip
            yield Rec(topic, f"t-{i}".encode(), exact(orjson.dumps({
                "task_id": f"t-{i}", "pipeline": "comment-analysis", "source": source,
                "history": history})))  # fmt: skip

    async def read_at(settings: Settings, sources: list[tuple[str, int, int]]) -> dict:
        return {s: orjson.dumps({"task_id": f"t-{s[2]}", "pipeline": "comment-analysis",
                                 "input": {"text": "text"}}) for s in sources}  # fmt: skip

    serving(monkeypatch, {topic: states})
    monkeypatch.setattr(backtrack_module, "read_at", read_at)
    registry = PipelineRegistry.load(ROOT / "pipelines", ROOT / "schemas")
    plan = await backtrack(settings, registry, selection, "rerun", "v1", dry_run=True)
    assert (plan.sent, plan.done) == (4, ["t-0"])


async def test_a_drift_holds_each_versions_latest_window_not_every_answer(
    monkeypatch: pytest.MonkeyPatch, settings: Settings
) -> None:
    schema = orjson.loads((ROOT / "schemas" / "comment-analysis.output.schema.json").read_bytes())
    labels = ("positive", "negative", "neutral")

    def answer(i: int) -> dict[str, Any]:
        return {"sentiment": labels[i % 3] if i < 2_900 else "negative", "confidence": 0.5,
                "topics": ["fit"], "summary": "s" * 150, "language": "en",
                "evidence": [{"quote": "q" * 300}] * 4}  # fmt: skip

    def results() -> Iterator[Rec]:
        for i in range(3_000):  # 6 MB of answers; written out of time order per partition
            at = f"2026-12-06T00:{i // 60 % 60:02d}:{i % 60:02d}.{(i * 7) % 1000:03d}Z"
            yield Rec(settings.topics.results, f"k-{i}".encode(), exact(orjson.dumps({
                "pipeline": "comment-analysis", "prompt_version": "v1", "processed_at": at,
                "output": answer(i)})))  # fmt: skip

    serving(monkeypatch, {settings.topics.results: results})
    tracemalloc.start()
    try:
        found = await drift_module.answers(
            settings,
            "comment-analysis",
            schema,
            window=100,
            between=("2026-12-06T00:00:00", "2026-12-06T00:00:30"),
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    v1 = found["v1"]
    times = sorted(at for at, _ in v1.rows())
    assert len(times) == 100 and times == [at for at, _ in v1.rows()]  # oldest first
    assert min(times) >= "2026-12-06T00:48:20"  # the latest 100 of 3,000 by time
    assert v1.between.answers == 30  # :00 to :29 summed up, not held
    assert v1.between.counts["sentiment"]["positive"] == 10
    assert peak < 4_000_000, f"peak {peak:,} bytes"  # the answers held: past 6 MB


async def test_a_replay_holds_the_keys_of_the_live_results_of_its_pipeline_and_version_alone(
    monkeypatch: pytest.MonkeyPatch, settings: Settings
) -> None:
    def results() -> Iterator[Rec]:
        for i in range(3_000):
            pipeline, version = ("p", "v1") if i % 3 else ("q", "v2" if i % 2 else "v1")
            yield Rec(settings.topics.results, f"rk-{i}".encode(), orjson.dumps({
                "pipeline": pipeline, "prompt_version": version,
                "usage": {"prompt_tokens": 10, "completion_tokens": 4 if pipeline == "p" else 8},
            }))  # fmt: skip

        yield Rec(settings.topics.results, b"rk-3", None)  # tombstoned: past its retention

    serving(monkeypatch, {settings.topics.results: results})
    every = await replay_module.read_answered(settings)
    ours = await replay_module.read_answered(settings, "q", "v2")
    assert len(every.keys) == 2_999 and len(ours.keys) == 499
    assert b"rk-3" not in every.keys  # its task is replayed, not skipped as answered
    assert all(int(k[3:]) % 6 == 3 for k in ours.keys)
    # The completion estimates still come from every result.
    assert ours.usage == every.usage and ours.completion_estimate("p", "v1") == 4


async def test_a_replay_tells_the_results_an_earlier_definition_of_their_version_made(
    monkeypatch: pytest.MonkeyPatch, settings: Settings
) -> None:
    """v1 edited in place since: its results made by the old definition are told from
    those of the new one (and from results older than the digest, which say nothing);
    a task answered again by the new definition is no longer stale."""

    def results() -> Iterator[Rec]:
        for i, made in enumerate(["old", "new", None, "old"]):
            yield Rec(settings.topics.results, f"rk-{i}".encode(), orjson.dumps(
                {"pipeline": "p", "prompt_version": "v1"}
                | ({"prompt_digest": made} if made else {})
            ))  # fmt: skip
        yield Rec(settings.topics.results, b"rk-3", orjson.dumps(
            {"pipeline": "p", "prompt_version": "v1", "prompt_digest": "new"}))  # fmt: skip

    serving(monkeypatch, {settings.topics.results: results})
    now = {("p", "v1"): "new"}
    answered = await replay_module.read_answered(
        settings, "p", "v1", lambda p, v, made: (p, v) in now and made != now[(p, v)]
    )
    assert len(answered.keys) == 4 and answered.stale == {b"rk-0"}


async def test_a_diff_holds_one_partitions_outputs_and_leaves_out_a_tombstoned_result(
    monkeypatch: pytest.MonkeyPatch, settings: Settings
) -> None:
    """2,000 tasks under two versions, 2 KB an output, over 8 partitions: a diff held
    every output of both (peak 10.6 MB here); now one partition's at a time, the same
    figures. A task whose v2 result was erased since is compared no more."""
    schema = {"properties": {"sentiment": {"type": "string", "enum": ["pos", "neg"]},
                             "summary": {"type": "string"}}}  # fmt: skip
    topic, n = settings.topics.results, 2_000
    parts = 8

    def result(i: int, version: str, sentiment: str) -> bytes:
        return exact(
            orjson.dumps(
                {
                    "task_id": f"t-{i}",
                    "pipeline": "p",
                    "prompt_version": version,
                    "output": {"sentiment": sentiment, "summary": "s" * 2_000},
                }
            )
        )

    def results() -> Iterator[Rec]:
        yield Rec(topic, b"v1-old-5", result(5, "v1", "neg"), partition=5)  # replaced below
        for version in ("v1", "v2"):
            for i in range(n):
                flipped = "neg" if version == "v2" and i % 4 == 0 else "pos"
                yield Rec(topic, f"{version}-{i}".encode(), result(i, version, flipped),
                          partition=i % parts)  # fmt: skip
        yield Rec(topic, b"v1-extra", result(n, "v1", "pos"), partition=0)  # under v1 alone
        yield Rec(topic, b"v2-8", None, partition=0)  # t-8's v2 result erased
        yield Rec(topic, b"v1-old-5", None, partition=5)  # an earlier answer's, past retention

    serving(monkeypatch, {topic: results}, partitions=parts)
    tracemalloc.start()
    try:
        compared = await diff_module.compare(settings, "p", "v1", "v2", schema)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (compared.both, compared.only_from, compared.only_to) == (n - 1, 2, 0)
    sentiment = {d.name: d for d in compared.fields}["sentiment"]
    assert (sentiment.compared, sentiment.changed) == (n - 1, n // 4 - 1)  # t-8 left out
    assert peak < 4_000_000, f"peak {peak:,} bytes"


async def test_an_ab_report_holds_one_partitions_outputs_and_leaves_out_a_tombstoned_result(
    monkeypatch: pytest.MonkeyPatch, settings: Settings
) -> None:
    """2,000 tasks answered under two versions, 2 KB an output, over 8 partitions: the
    report held every output of both and a cost per task; now one partition's outputs,
    and counts. A task whose v2 result was erased since counts for v1 alone."""
    schema = {"properties": {"sentiment": {"type": "string", "enum": ["pos", "neg"]}}}
    topic, n, parts = settings.topics.results, 2_000, 8

    def results() -> Iterator[Rec]:
        # t-5's first answer under v1, to an earlier input: replaced by its latest below,
        # then tombstoned past its retention (which takes nothing of the latest).
        yield Rec(topic, b"v1-old-5", exact(orjson.dumps({
            "task_id": "t-5", "pipeline": "p", "prompt_version": "v1",
            "output": {"sentiment": "neg"}, "cost_usd": 0.001})), partition=5)  # fmt: skip
        for version in ("v1", "v2"):
            for i in range(n):
                sentiment = "neg" if version == "v2" and i % 4 == 0 else "pos"
                yield Rec(topic, f"{version}-{i}".encode(), exact(orjson.dumps({
                    "task_id": f"t-{i}", "pipeline": "p", "prompt_version": version,
                    "output": {"sentiment": sentiment, "summary": "s" * 2_000},
                    "cost_usd": 0.001})), partition=i % parts)  # fmt: skip
        yield Rec(topic, b"v2-8", None, partition=0)  # t-8's v2 result erased
        yield Rec(topic, b"v1-old-5", None, partition=5)

    serving(monkeypatch, {topic: results}, partitions=parts)
    tracemalloc.start()
    try:
        evidence = await ab.gather(settings, "p", schema)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    v1, v2 = evidence["v1"], evidence["v2"]
    assert (v1.evaluation.tasks, v2.evaluation.tasks) == (n, n - 1)
    assert ab.agreements(v1, v2) == [ab.Agreement("sentiment", n - n // 4, n - 1)]
    assert v1.cost_interval() == pytest.approx((0.001, 0.001, 0.001))
    assert peak < 4_000_000, f"peak {peak:,} bytes"  # every output held: past 8 MB
