"""Replay of a task topic's history through the replay lane, on real Kafka.

Answered tasks are skipped; a new prompt version answers everything again under
new keys; a killed replay resumes from its checkpoint; the same replay run twice
sends nothing twice; `--force` asks the LLM again under the same keys.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from streams.contract.headers import FORCE_HEADER, REPLAY_ID_HEADER, REPLAY_OF_HEADER
from streams.dev.simulator import SimulatorServer
from streams.kafka import clients
from streams.kafka.publisher import TaskPublisher
from streams.kafka.scan import scan
from streams.ops.replay import Checkpoint, Replayer, ReplayRequest
from streams.pipelines.registry import PipelineRegistry
from streams.settings import Settings
from tests.integration.helpers import WorkerProcess, collect, produce, run_cli, topic_takes

pytestmark = pytest.mark.integration

TASKS = 1200
ROOT = Path(__file__).resolve().parents[2]


class Interrupted(Exception):
    pass


def _pipelines_with_v2(tmp_path: Path) -> Path:
    """The shipped pipeline plus a v2 with another system prompt (a prompt improved)."""
    spec = yaml.safe_load((ROOT / "pipelines" / "comment-analysis.yaml").read_text())
    v2 = dict(spec["versions"]["v1"])
    v2["system"] = v2["system"] + "Be brief.\n"
    spec["versions"]["v2"] = v2
    folder = tmp_path / "pipelines"
    folder.mkdir()
    (folder / "comment-analysis.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return folder


async def _replay_records(settings: Settings) -> list[Any]:
    return [r async for batch in scan(settings, settings.topics.replay) for r in batch]


async def _send_again(settings: Settings, records: list[Any], run_of_last: bytes) -> list[int]:
    """`records` of the replay topic sent to it again, in order, each to its partition with
    its headers (the last one's run id replaced by `run_of_last`); their new offsets."""
    producer = clients.producer(settings, acks="all")
    await producer.start()
    try:
        offsets = []
        for i, r in enumerate(records):
            headers = list(r.headers)
            if i == len(records) - 1:
                headers = [(k, run_of_last if k == REPLAY_ID_HEADER else v) for k, v in headers]
            sent = await producer.send_and_wait(settings.topics.replay, key=r.key, value=r.value,
                                                partition=r.partition, headers=headers)  # fmt: skip
            offsets.append(sent.offset)
        return offsets
    finally:
        await producer.stop()


async def test_replay_skips_answered_resumes_after_a_kill_and_force_asks_again(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    settings = make_settings(
        llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1"},
        pipelines_dir=_pipelines_with_v2(tmp_path),
    )
    registry = PipelineRegistry.load(settings.pipelines_dir, settings.schemas_dir)
    tasks = [{"task_id": f"h-{i:05d}", "pipeline": "comment-analysis",
              "input": {"text": f"Old comment {i}: the lid cracked after {i} days."}}
             for i in range(TASKS)]  # fmt: skip
    records: list[tuple[bytes | None, bytes | None]] = [
        (t["task_id"].encode(), orjson.dumps(t)) for t in tasks
    ]
    records.append((b"bad-1", b"{not json"))  # history holds bad records too
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        offsets = await produce(settings, records)
        first = await collect(settings, set(offsets), timeout_s=180, worker=worker)
        assert len(first.results) == TASKS and len(first.dead_letters) == 1
        v1_keys = {r["task_id"]: r["result_key"] for r in first.results}
        calls_v1 = simulator.sim.snapshot()["requests"]

        everything = ReplayRequest(source=settings.topics.tasks,
                                   since=datetime.now(UTC) - timedelta(hours=1))  # fmt: skip
        # Same version: every task is answered already; nothing is sent.
        same = await Replayer(settings, everything, registry).run(dry_run=False)
        assert same.done and same.counts.answered == TASKS and same.counts.published == 0
        assert same.counts.invalid == 1 and same.counts.read == TASKS + 1
        assert await _replay_records(settings) == []

        # Dry run under v2: the plan and its estimate, nothing sent.
        v2 = ReplayRequest(source=settings.topics.tasks, from_offsets={p: 0 for p in range(4)},
                           prompt_version="v2")  # fmt: skip
        dry = await Replayer(settings, v2, registry).run(dry_run=True)
        assert dry.counts.published == TASKS and dry.counts.answered == 0
        assert dry.counts.prompt_tokens > TASKS * 50 and dry.counts.cost_usd(settings) > 0
        # The completion estimate comes from the v1 results' real usage.
        mean_v1 = sum(r["usage"]["completion_tokens"] for r in first.results) / TASKS
        assert dry.counts.completion_tokens == pytest.approx(mean_v1 * TASKS)
        assert await _replay_records(settings) == []

        # v2 for real, killed part way (after a checkpoint), then run again: it resumes.
        def kill_midway(cp: Checkpoint) -> None:
            if cp.progressed >= 500:
                raise Interrupted

        with pytest.raises(Interrupted):
            await Replayer(settings, v2, registry, chunk=100).run(
                dry_run=False, on_progress=kill_midway
            )
        sent_before_kill = len(await _replay_records(settings))
        assert 400 <= sent_before_kill < TASKS
        resumed = Replayer(settings, v2, registry, chunk=100)
        cp = await resumed.run(dry_run=False)
        assert resumed.resumed_at and cp.done
        replayed = await _replay_records(settings)
        origins = Counter(dict(r.headers)[REPLAY_OF_HEADER] for r in replayed)
        assert len(origins) == TASKS  # every valid task of the range, the bad one not
        assert len(replayed) - TASKS < 100  # re-sent: at most the chunk after the checkpoint
        assert {dict(r.headers)[REPLAY_ID_HEADER] for r in replayed} == {v2.replay_id().encode()}
        assert all(orjson.loads(r.value)["prompt_version"] == "v2" for r in replayed)

        got = await collect(settings, set(), timeout_s=180, worker=worker,
                            until=lambda c: len({r["task_id"] for r in c.results
                                                 if r["prompt_version"] == "v2"}) == TASKS)  # fmt: skip
        v2_results = [r for r in got.results if r["prompt_version"] == "v2"]
        v2_keys = {r["task_id"]: r["result_key"] for r in v2_results}
        assert len(v2_keys) == TASKS
        assert all(v2_keys[t] != v1_keys[t] for t in v2_keys)  # new version, new keys
        assert all(len({r["result_key"] for r in v2_results if r["task_id"] == t}) == 1
                   for t in list(v2_keys)[:50])  # fmt: skip
        # One LLM call per task: records re-sent by the resume were answered from the store.
        calls_v2 = simulator.sim.snapshot()["requests"] - calls_v1
        assert calls_v2 == TASKS, calls_v2
        assert all(r["source"]["topic"] == settings.topics.replay for r in v2_results)

        # The same replay again: finished, nothing sent.
        again = Replayer(settings, v2, registry)
        await again.run(dry_run=False)
        assert again.finished_before and len(await _replay_records(settings)) == len(replayed)

        # Force, partition 0 only, under v1: the LLM is asked again, same keys.
        in_p0 = {t["task_id"] for (p, _), t in zip(offsets[:TASKS], tasks, strict=True) if p == 0}
        force = ReplayRequest(source=settings.topics.tasks, from_offsets={0: 0},
                              prompt_version="v1", force=True)  # fmt: skip
        before = simulator.sim.snapshot()["requests"]  # (the worker starts on them at once)
        forced = await Replayer(settings, force, registry).run(dry_run=False)
        assert forced.counts.published == len(in_p0) > 0
        forced_records = [r for r in await _replay_records(settings)
                          if dict(r.headers)[REPLAY_ID_HEADER] == force.replay_id().encode()]  # fmt: skip
        assert len(forced_records) == len(in_p0)
        assert all(dict(r.headers).get(FORCE_HEADER) == b"1" for r in forced_records)
        got = await collect(settings, set(), timeout_s=120, worker=worker,
                            until=lambda c: len([r for r in c.results if r["prompt_version"] == "v1"
                                                 and r["source"]["topic"] == settings.topics.replay])
                            >= len(in_p0))  # fmt: skip
        again_v1 = [r for r in got.results if r["prompt_version"] == "v1"
                    and r["source"]["topic"] == settings.topics.replay]  # fmt: skip
        assert {r["task_id"] for r in again_v1} == in_p0
        assert all(r["result_key"] == v1_keys[r["task_id"]] and not r["cached"] for r in again_v1)
        assert simulator.sim.snapshot()["requests"] - before == len(in_p0)

        # The forced records sent again, as a run killed after sending and before its
        # checkpoint sends them on its next run: each copy ends nothing again. A record
        # of another run sent after them, on the same partition, is answered.
        sentinel = forced_records[0]
        resent = await _send_again(settings, [*forced_records, sentinel],
                                   run_of_last=b"rp-another")  # fmt: skip
        got = await collect(settings, set(), timeout_s=120, worker=worker,
                            until=lambda c: any(r["source"]["offset"] == resent[-1]
                                                and r["source"]["topic"] == settings.topics.replay
                                                for r in c.results))  # fmt: skip
        again_sent = {r["source"]["offset"] for r in got.results
                      if r["source"]["topic"] == settings.topics.replay}  # fmt: skip
        assert again_sent.isdisjoint(resent[:-1])  # no copy answered again
        assert simulator.sim.snapshot()["requests"] - before == len(in_p0) + 1

        # The command line: a dry run prints the plan and the estimate, sends nothing.
        shown = run_cli(settings, "replay", "--from-offset", "0:0", "--prompt-version", "v2",
                     "--dry-run")  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        assert f"would send 0 to {settings.topics.replay}" in shown.stdout, shown.stdout
        assert f"skipped {len(in_p0)} already answered" in shown.stdout
        assert "estimated cost $" in shown.stdout
        bad = run_cli(settings, "replay", "--prompt-version", "v2")
        assert bad.returncode == 2 and "--from" in bad.stderr

        # A budget for the run: it stops before the task that would pass it, and goes on
        # from there when run again with a higher one (the same replay, resumed).
        per_task = forced.counts.estimated_usd / len(in_p0)
        args = ["replay", "--from-offset", "0:1", "--prompt-version", "v1", "--force"]
        capped = run_cli(settings, *args, "--budget-usd", f"{per_task * 3.5:.8f}")
        assert capped.returncode == 0, capped.stderr
        assert "stopped at the budget" in capped.stdout, capped.stdout
        budgeted = ReplayRequest(source=settings.topics.tasks, from_offsets={0: 1},
                                 prompt_version="v1", force=True).replay_id().encode()  # fmt: skip

        async def sent_by_it() -> int:
            return sum(1 for r in await _replay_records(settings)
                       if dict(r.headers)[REPLAY_ID_HEADER] == budgeted)  # fmt: skip

        assert 2 <= await sent_by_it() <= 4  # ~3.5 tasks' estimate: three of them
        raised = run_cli(settings, *args, "--budget-usd", "1000")
        assert raised.returncode == 0, raised.stderr
        assert "stopped at the budget" not in raised.stdout and "resumed" in raised.stdout
        after_first = {t["task_id"] for (p, o), t in zip(offsets[:TASKS], tasks, strict=True)
                       if p == 0 and o >= 1}  # fmt: skip
        assert await sent_by_it() == len(after_first)  # each once, across the two runs
        wanted = len(in_p0) + len(after_first)  # answered before the store is checked below
        await collect(settings, set(), timeout_s=120, worker=worker,
                      until=lambda c: len([r for r in c.results if r["prompt_version"] == "v1"
                                           and r["source"]["topic"] == settings.topics.replay])
                      >= wanted)  # fmt: skip

        # Backtrack: three tasks back to their v1 answers (no LLM call), seen in their history.
        picked = ["h-00003", "h-00500", "h-01100"]
        before = simulator.sim.snapshot()["requests"]
        restore = run_cli(settings, "backtrack", *picked, "h-99999", "--restore", "v1")
        assert restore.returncode == 0, restore.stderr
        assert "sent 3 task(s) to restore" in restore.stdout and "no state for 1" in restore.stdout
        got = await collect(settings, set(), timeout_s=120, worker=worker,
                            until=lambda c: {r["task_id"] for r in c.results if r["cached"]
                                             and r["prompt_version"] == "v1"} >= set(picked))  # fmt: skip
        restored = [r for r in got.results if r["cached"] and r["prompt_version"] == "v1"]
        assert {r["task_id"] for r in restored} == set(picked)
        assert all(r["result_key"] == v1_keys[r["task_id"]] for r in restored)
        assert simulator.sim.snapshot()["requests"] == before  # answered from the store
        shown = run_cli(settings, "status", "h-00500")
        assert shown.returncode == 0, shown.stderr
        assert "backtrack: restored" in shown.stdout and v1_keys["h-00500"] in shown.stdout
        # The same backtrack again (as after a kill half-way): what it put back, unchanged
        # since, is left out.
        again = run_cli(settings, "backtrack", *picked, "h-99999", "--restore", "v1")
        assert again.returncode == 0, again.stderr
        assert "sent 0 task(s) to restore" in again.stdout, again.stdout
        assert "skipped 3 this backtrack already put back" in again.stdout, again.stdout
        never = run_cli(settings, "backtrack", "h-00004", "--restore", "v3")
        assert never.returncode == 2 and "no prompt version 'v3'" in never.stderr + never.stdout

        # Diff of the two versions over the tasks answered under both.
        compared = run_cli(settings, "diff", "--pipeline", "comment-analysis",
                        "--from-version", "v1", "--to-version", "v2")  # fmt: skip
        assert compared.returncode == 0, compared.stderr
        assert f"{TASKS} task(s) answered under both v1 and v2" in compared.stdout
        assert "sentiment" in compared.stdout and "confidence" in compared.stdout

        # A range after the last record: nothing to replay.
        later = ReplayRequest(source=settings.topics.tasks,
                              since=datetime.now(UTC) + timedelta(hours=1))  # fmt: skip
        empty = await Replayer(settings, later, registry).run(dry_run=True)
        assert empty.total == 0 and empty.counts.read == 0
    finally:
        worker.stop()


async def test_an_idle_replay_lane_is_left_out_of_fetches_and_taken_up_when_records_come(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    """The worker leaves the replay partitions it has read to their end out of its fetches
    (`kafka.replay_idle_check_s`): a replay written then is still answered, each task once,
    live tasks meanwhile too, and the partitions are left out again once it is read."""
    settings = make_settings(
        llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1"},
        kafka={"replay_idle_check_s": 0.5},
    )
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    partitions = settings.kafka.partitions

    async def idle_partitions() -> float:
        return (await worker.scrape()).value("llm_streams_replay_partitions_idle")

    async def until_idle(n: int) -> None:
        for _ in range(120):
            if await idle_partitions() == n:
                return
            await asyncio.sleep(0.5)
        raise AssertionError(f"replay partitions idle: {await idle_partitions()}, not {n}\n"
                             + worker.log_tail())  # fmt: skip

    def task(task_id: str) -> tuple[bytes, bytes]:
        body = {"task_id": task_id, "pipeline": "comment-analysis",
                "input": {"text": f"Comment {task_id}: fine."}}  # fmt: skip
        return task_id.encode(), orjson.dumps(body)

    try:
        live = await produce(settings, [task(f"live-{i}") for i in range(8)])
        await collect(settings, set(live), timeout_s=120, worker=worker)
        await until_idle(partitions)  # every replay partition left out
        producer = clients.producer(settings, acks="all")
        await producer.start()
        try:
            sent = [await producer.send_and_wait(settings.topics.replay, value, key=key)
                    for key, value in (task(f"replayed-{i}") for i in range(40))]  # fmt: skip
        finally:
            await producer.stop()
        replayed = {(m.partition, m.offset) for m in sent}
        assert {p for p, _ in replayed} == set(range(partitions))  # every partition woken
        got = await collect(settings, replayed, timeout_s=120, worker=worker,
                            until=lambda c: len([r for r in c.results
                                                 if r["task_id"].startswith("replayed-")]) >= 40)  # fmt: skip
        from_replay = [r for r in got.results if r["source"]["topic"] == settings.topics.replay]
        assert sorted(r["task_id"] for r in from_replay) == sorted(
            f"replayed-{i}" for i in range(40)
        )
        await until_idle(partitions)  # read to their end again: left out again
    finally:
        worker.stop()


async def test_a_record_the_replay_topic_refuses_is_counted_and_the_replay_ends(
    make_settings: Any,
) -> None:
    """The replay topic takes 20 KB records; one task of the range is 30 KB. Before, the
    broker's refusal stopped the replay, and every run resumed from its checkpoint met it
    again first: the rest of the range was never replayed."""
    settings = make_settings()
    registry = PipelineRegistry.load(settings.pipelines_dir, settings.schemas_dir)
    tasks = [{"task_id": f"r-{i}", "pipeline": "comment-analysis",
              "input": {"text": f"Comment {i}."},
              "metadata": {"note": ("Long " * 6_000) if i == 3 else ""}}
             for i in range(8)]  # fmt: skip
    await produce(settings, [(t["task_id"].encode(), orjson.dumps(t)) for t in tasks])
    await topic_takes(settings, settings.topics.replay, 20_000)
    request = ReplayRequest(source=settings.topics.tasks,
                            since=datetime.now(UTC) - timedelta(hours=1))  # fmt: skip
    done = await Replayer(settings, request, registry).run(dry_run=False)
    assert done.done and (done.counts.published, done.counts.refused) == (7, 1)
    sent = {orjson.loads(r.value)["task_id"] for r in await _replay_records(settings)}
    assert sent == {t["task_id"] for t in tasks} - {"r-3"}
    again = Replayer(settings, request, registry)
    assert (await again.run(dry_run=False)).done and again.finished_before


async def test_publish_sends_the_lines_its_topic_takes_and_names_the_one_it_refuses(
    make_settings: Any, tmp_path: Path
) -> None:
    """Before, a publish never looked at its sends' answers: it said "published 5" of a
    file whose third line the tasks topic had refused."""
    settings = make_settings()
    await topic_takes(settings, settings.topics.tasks, 20_000)
    lines = [orjson.dumps({"task_id": f"p-{i}", "input": {"text": f"Comment {i}."},
                           "metadata": {"note": ("Long " * 6_000) if i == 3 else ""}})
             for i in range(1, 6)]  # fmt: skip
    (tmp_path / "tasks.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    done = run_cli(settings, "publish", str(tmp_path / "tasks.jsonl"))
    assert done.returncode == 1, done.stderr
    assert "published 4 task(s)" in done.stderr
    assert "1 record_too_large (line 3)" in done.stderr
    sent = [r async for batch in scan(settings, settings.topics.tasks) for r in batch]
    assert sorted(orjson.loads(r.value)["task_id"] for r in sent) == ["p-1", "p-2", "p-4", "p-5"]


async def test_a_replay_sends_no_record_of_a_task_older_than_its_erasure(
    make_settings: Any,
) -> None:
    """The erased task's record stays on the tasks topic until its retention: a replay
    over it answered it again, writing back the answer its erasure had taken away. A
    task sent again after its erasure is new, and replayed."""
    settings = make_settings()
    registry = PipelineRegistry.load(settings.pipelines_dir, settings.schemas_dir)

    def task(task_id: str, text: str) -> tuple[bytes, bytes]:
        return task_id.encode(), orjson.dumps({"task_id": task_id, "pipeline": "comment-analysis",
                                               "input": {"text": text}})  # fmt: skip

    await produce(settings, [task("e-1", "First."), task("e-2", "Mine."), task("e-3", "Third.")])
    await asyncio.sleep(0.05)
    async with TaskPublisher(settings) as publisher:
        await publisher.erase("e-2", "comment-analysis")
    await asyncio.sleep(0.05)
    await produce(settings, [task("e-2", "Sent again, after the erasure.")])
    request = ReplayRequest(source=settings.topics.tasks,
                            since=datetime.now(UTC) - timedelta(hours=1))  # fmt: skip
    done = await Replayer(settings, request, registry).run(dry_run=False)
    assert (done.counts.published, done.counts.erased) == (3, 1)
    sent = [orjson.loads(r.value)["input"]["text"] for r in await _replay_records(settings)]
    assert sorted(sent) == ["First.", "Sent again, after the erasure.", "Third."]
