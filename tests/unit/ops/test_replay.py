"""Replay planning without a broker: ids, checkpoints, and what each record becomes."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka.structs import ConsumerRecord

from streams.cli import replay as replay_cli
from streams.contract.records import result_key
from streams.errors import ConfigError, InvalidInput
from streams.ops.replay import (
    FORCE_HEADER,
    REPLAY_ID_HEADER,
    REPLAY_OF_HEADER,
    Answered,
    AtBudget,
    Checkpoint,
    Counts,
    Replayer,
    ReplayRequest,
)
from streams.pipelines.registry import PipelineRegistry
from streams.settings import load_settings

ROOT = Path(__file__).resolve().parents[3]
SINCE = datetime(2026, 11, 1, tzinfo=UTC)


@pytest.fixture
def registry() -> PipelineRegistry:
    return PipelineRegistry.load(ROOT / "pipelines", ROOT / "schemas")


def record(value: bytes | None, offset: int = 7) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord(topic="llm-tasks", partition=2, offset=offset, timestamp=0,
                          timestamp_type=0, key=b"k", value=value, checksum=None,
                          serialized_key_size=1, serialized_value_size=0, headers=())  # fmt: skip


def task(text: str = "The zip broke.", **extra: Any) -> bytes:
    return orjson.dumps({"task_id": "t-1", "pipeline": "comment-analysis",
                         "input": {"text": text}, **extra})  # fmt: skip


def checkpoint() -> Checkpoint:
    return Checkpoint(replay_id="rp-x", source="llm-tasks", start={0: 0, 1: 5},
                      end={0: 10, 1: 5}, next={0: 0, 1: 5}, counts=Counts())  # fmt: skip


def test_the_same_arguments_give_the_same_replay_id() -> None:
    a = ReplayRequest(source="llm-tasks", since=SINCE, prompt_version="v2")
    assert a.replay_id() == ReplayRequest(source="llm-tasks", since=SINCE,
                                          prompt_version="v2").replay_id()  # fmt: skip
    assert a.replay_id().startswith("rp-")
    others = [
        ReplayRequest(source="llm-tasks", since=SINCE, prompt_version="v3"),
        ReplayRequest(source="llm-tasks", since=SINCE, prompt_version="v2", force=True),
        ReplayRequest(source="other", since=SINCE, prompt_version="v2"),
        ReplayRequest(source="llm-tasks", from_offsets={0: 3}, prompt_version="v2"),
    ]
    assert len({a.replay_id(), *(o.replay_id() for o in others)}) == 5


def test_a_checkpoint_round_trips_with_its_progress() -> None:
    cp = checkpoint()
    cp.next[0] = 4
    cp.counts.published = 3
    back = Checkpoint.loads(cp.dumps())
    assert back.start == cp.start and back.next == {0: 4, 1: 5} and back.counts.published == 3
    assert back.total == 10 and back.progressed == 4 and back.updated_at


def test_a_task_not_answered_is_sent_pinned_to_the_version_with_its_origin(
    registry: PipelineRegistry,
) -> None:
    settings = load_settings()
    replayer = Replayer(settings, ReplayRequest(source="llm-tasks", since=SINCE), registry)
    cp = checkpoint()
    sent = replayer.publication(record(task()), cp)
    assert sent is not None
    key, value, headers = sent
    assert key == b"t-1" and orjson.loads(value)["prompt_version"] == "v1"
    assert dict(headers) == {REPLAY_ID_HEADER: b"rp-x", REPLAY_OF_HEADER: b"llm-tasks/2/7"}
    c = cp.counts
    assert (c.read, c.published) == (1, 1) and c.prompt_tokens > 50
    assert c.completion_tokens == 400  # no earlier results: the version's max_tokens


def test_answered_tasks_are_skipped_unless_forced(registry: PipelineRegistry) -> None:
    settings = load_settings()
    rk = result_key("comment-analysis", "v1", "t-1", {"text": "The zip broke."})
    plain = Replayer(settings, ReplayRequest(source="llm-tasks", since=SINCE), registry)
    plain.answered = Answered(keys={rk.encode()})
    cp = checkpoint()
    assert plain.publication(record(task()), cp) is None and cp.counts.answered == 1
    forced = Replayer(settings, ReplayRequest(source="llm-tasks", since=SINCE, force=True),
                      registry)  # fmt: skip
    forced.answered = Answered({rk.encode()}, {("comment-analysis", None): (300, 3)})
    cp = checkpoint()
    sent = forced.publication(record(task()), cp)
    assert sent is not None and dict(sent[2])[FORCE_HEADER] == b"1"
    assert cp.counts.completion_tokens == 100  # mean of the earlier results


def test_a_task_answered_by_an_earlier_definition_of_its_version_is_counted_and_said(
    registry: PipelineRegistry, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """v1 edited in place, then replayed without --force: its tasks are skipped as
    answered — the summary said only that, and the user took the history for re-analysed.
    It says how many an earlier definition answered, and the ways to ask them again."""
    settings = load_settings()
    rk = result_key("comment-analysis", "v1", "t-1", {"text": "The zip broke."})
    replayer = Replayer(settings, ReplayRequest(source="llm-tasks", since=SINCE), registry)
    replayer.answered = Answered(keys={rk.encode()}, stale={rk.encode()})
    cp = checkpoint()
    assert replayer.publication(record(task()), cp) is None
    assert (cp.counts.answered, cp.counts.stale) == (1, 1)
    assert Checkpoint.loads(cp.dumps()).counts.stale == 1
    now = registry.get("comment-analysis").version("v1").digest
    assert not replayer._made_otherwise("comment-analysis", "v1", now)
    assert replayer._made_otherwise("comment-analysis", "v1", "0123456789abcdef")
    assert not replayer._made_otherwise("comment-analysis", "v9", "0123456789abcdef")
    replay_cli._summary(settings, replayer, cp, dry_run=True, tier=None)
    said = " ".join(capsys.readouterr().out.split())
    assert ("skipped 1 already answered (1 of them by an earlier definition of their version, "
            "edited in place since: --force asks them again, or name the edit as a new "
            "version)") in said  # fmt: skip


def test_bad_records_and_other_pipelines_are_counted_not_sent(registry: PipelineRegistry) -> None:
    settings = load_settings()
    only = ReplayRequest(source="llm-tasks", since=SINCE, pipeline="comment-analysis")
    replayer = Replayer(settings, only, registry)
    cp = checkpoint()
    assert replayer.publication(record(b"{not json"), cp) is None
    assert replayer.publication(record(None), cp) is None
    assert replayer.publication(record(task(prompt_version="v9")), cp) is None  # unknown version
    other = orjson.dumps({"task_id": "t-2", "pipeline": "tickets", "input": {"text": "x"}})
    assert replayer.publication(record(other), cp) is None
    assert (cp.counts.invalid, cp.counts.filtered, cp.counts.published) == (3, 1, 0)


def test_an_unknown_pipeline_or_version_is_refused_before_anything_is_read(
    registry: PipelineRegistry,
) -> None:
    settings = load_settings()
    with pytest.raises(InvalidInput, match="no prompt version 'v9'"):
        Replayer(settings, ReplayRequest(source="t", since=SINCE, pipeline="comment-analysis",
                                         prompt_version="v9"), registry)  # fmt: skip
    with pytest.raises(InvalidInput):
        Replayer(settings, ReplayRequest(source="t", since=SINCE, pipeline="nope"), registry)


def test_cost_uses_the_price_table() -> None:
    settings = load_settings(llm={"price_per_1k_prompt_usd": 1.0,
                                  "price_per_1k_completion_usd": 2.0})  # fmt: skip
    assert Counts(prompt_tokens=1000, completion_tokens=500).cost_usd(settings) == 2.0


def test_a_budget_stops_the_run_before_the_task_that_would_pass_it(
    registry: PipelineRegistry,
) -> None:
    """Each task's cost is estimated at its lane's price before it is sent: the first
    that would take the run past its budget is not sent, nor counted as read (the replay
    goes on from it when run again with a higher budget)."""
    settings = load_settings(llm={"price_per_1k_prompt_usd": 1.0,
                                  "price_per_1k_completion_usd": 2.0})  # fmt: skip
    unlimited = Replayer(settings, ReplayRequest(source="llm-tasks", since=SINCE), registry)
    cp = checkpoint()
    assert unlimited.publication(record(task()), cp) is not None
    one = cp.counts.estimated_usd  # a task's estimate: its prompt, 400 tokens of answer
    assert one == pytest.approx(cp.counts.prompt_tokens / 1000 + 400 * 2 / 1000)
    request = ReplayRequest(source="llm-tasks", since=SINCE, budget_usd=2.5 * one)
    assert request.replay_id() == ReplayRequest(source="llm-tasks", since=SINCE).replay_id()
    capped = Replayer(settings, request, registry)
    cp = checkpoint()
    for offset in (7, 8):
        assert capped.publication(record(task(), offset), cp) is not None
    with pytest.raises(AtBudget):
        capped.publication(record(task(), 9), cp)
    c = cp.counts
    assert (c.read, c.published) == (2, 2) and c.estimated_usd == pytest.approx(2 * one)
    cp.at_budget = True
    back = Checkpoint.loads(cp.dumps())
    assert back.at_budget and back.counts.estimated_usd == pytest.approx(2 * one)


def test_a_checkpoint_a_newer_version_wrote_is_read_without_its_new_counts() -> None:
    raw = orjson.loads(checkpoint().dumps())
    raw["counts"]["tokens_of_a_later_kind"] = 7
    raw["something_new"] = True
    back = Checkpoint.loads(orjson.dumps(raw))
    assert back.replay_id == "rp-x" and back.counts.published == 0


def stored(*values: bytes | None) -> list[ConsumerRecord[bytes, bytes]]:
    """Checkpoint records of replay rp-x in the order they were written."""
    return [ConsumerRecord(topic="llm-streams-replays", partition=0, offset=n, timestamp=0,
                           timestamp_type=0, key=b"rp-x", value=v, checksum=None,
                           serialized_key_size=4, serialized_value_size=0, headers=())
            for n, v in enumerate(values)]  # fmt: skip


def loaded(monkeypatch: pytest.MonkeyPatch, records: list[Any]) -> Checkpoint | None:
    import asyncio

    import streams.ops.replay as replay

    async def scan(*_: Any, **__: Any) -> Any:
        yield records

    monkeypatch.setattr(replay, "scan", scan)
    return asyncio.run(replay.load_checkpoint(load_settings(), "rp-x"))


def test_an_unreadable_checkpoint_gives_way_to_the_one_before_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first = checkpoint()
    later = checkpoint()
    later.next = {0: 6, 1: 5}
    cut = later.dumps()[:20]
    no_counts = orjson.dumps({k: v for k, v in orjson.loads(later.dumps()).items()
                              if k != "counts"})  # fmt: skip
    odd_offsets = later.dumps().replace(b'"next":{"0":6', b'"next":{"0":"six"')
    for bad in (cut, no_counts, odd_offsets, b'"a string"'):
        back = loaded(monkeypatch, stored(first.dumps(), bad))
        assert back is not None and back.next == {0: 0, 1: 5}
    back = loaded(monkeypatch, stored(first.dumps(), cut, later.dumps()))
    assert back is not None and back.next == {0: 6, 1: 5}
    assert loaded(monkeypatch, stored(first.dumps(), None)) is None  # deleted: start over


def test_a_replay_whose_only_checkpoint_is_unreadable_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ConfigError, match=r"rp-x: its only checkpoint .* cannot be read"):
        loaded(monkeypatch, stored(checkpoint().dumps()[:20]))
