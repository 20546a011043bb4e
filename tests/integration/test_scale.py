"""Several workers in one consumer group on a 12-partition topic, and the faults
around them: a worker SIGKILLed mid-run, the broker restarted mid-run, the LLM
provider unreachable for 30 s, and (3-broker cluster, replication factor 3,
min.insync.replicas 2) one broker killed mid-run.

In every case each task ends as exactly one outcome: its result (repeated only
under the same result key with the same output, which the compacted results
topic folds into one) or its dead letter, never both, never none.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka import TopicPartition

from streams.dev.brokers.apache import ApacheKafka
from streams.dev.simulator import SimulatorServer
from streams.kafka import clients
from streams.settings import Settings
from streams.store.taskstore import store_topics
from tests.integration.helpers import (
    Collected,
    Scrape,
    WorkerProcess,
    assert_one_outcome_each,
    collect,
    produce,
)

# Slow: waits out real timeouts, windows and sessions (tens of seconds each).
pytestmark = [pytest.mark.integration, pytest.mark.slow]

PARTITIONS = 12
LOADED = "llm_streams_state_loaded_records_total"


async def _store_records(settings: Settings, partitions: set[int]) -> int:
    """Records in `partitions` of the task store's topics (their end offsets, summed)."""
    consumer = clients.consumer(settings, purpose="ends", group_id=None)
    await consumer.start()
    try:
        tps = [TopicPartition(t, p) for t in store_topics(settings).values() for p in partitions]
        return sum((await consumer.end_offsets(tps)).values())
    finally:
        await consumer.stop()


def _tasks(n: int, prefix: str) -> list[tuple[bytes | None, bytes | None]]:
    texts = ["Great value, works as described.", "Stopped working after two days.",
             "物流很快，东西不错。", "The zip broke but support replaced it."]  # fmt: skip
    out: list[tuple[bytes | None, bytes | None]] = []
    for i in range(n):
        task = {"task_id": f"{prefix}-{i:05d}", "pipeline": "comment-analysis",
                "input": {"text": f"{texts[i % len(texts)]} ({i})"}}  # fmt: skip
        out.append((task["task_id"].encode(), orjson.dumps(task)))
    return out


def _ids(records: list[tuple[bytes | None, bytes | None]]) -> set[str]:
    return {k.decode() for k, _ in records if k}


async def _produce(
    settings: Settings, records: list[tuple[bytes | None, bytes | None]]
) -> dict[str, tuple[int, int]]:
    """`records` sent to the tasks topic; where each task went (partition, offset)."""
    placed = await produce(settings, records)
    return {k.decode(): at for (k, _), at in zip(records, placed, strict=True) if k}


class Group:
    """n worker processes with the same settings (one consumer group), each with its
    own data dir and web port."""

    def __init__(self, settings: Settings, n: int, logs: Path) -> None:
        self.workers = [
            WorkerProcess(
                settings.model_copy(update={"data_dir": logs / f"data-{i}"}),
                logs / f"worker-{i}.log",
            )
            for i in range(n)
        ]

    def start(self) -> Group:
        for w in self.workers:
            w.start()
        return self

    def stop(self) -> None:
        for w in self.workers:
            w.stop()

    def alive(self) -> list[WorkerProcess]:
        return [w for w in self.workers if w.alive()]

    async def scrapes(self) -> list[Scrape | None]:
        out: list[Scrape | None] = []
        for w in self.alive():
            try:
                out.append(await w.scrape())
            except OSError:
                out.append(None)
        return out

    def logs(self) -> str:
        return "\n---\n".join(w.log_tail(30) for w in self.workers)


def owned(scrape: Scrape | None, topic: str) -> set[int]:
    """Task partitions a worker reports lag for (those it is assigned and has fetched)."""
    if scrape is None:
        return set()
    return {int(labels["partition"]) for name, labels, _ in scrape.samples
            if name == "llm_streams_consumer_lag" and labels.get("topic") == topic}  # fmt: skip


async def wait_until(
    group: Group, check: Callable[[list[Scrape | None]], bool], *, timeout_s: float, what: str
) -> list[Scrape | None]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        scrapes = await group.scrapes()
        if check(scrapes):
            return scrapes
        await asyncio.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}:\n{group.logs()}")


def split_evenly(topic: str, n: int) -> Callable[[list[Scrape | None]], bool]:
    """Every live worker owns its share of the partitions, together all of them, and
    each has finished some of its tasks."""

    def check(scrapes: list[Scrape | None]) -> bool:
        parts = [owned(s, topic) for s in scrapes]
        done = [s.value("llm_streams_tasks_completed_total") if s else 0 for s in scrapes]
        return (
            len(scrapes) == n
            and all(len(p) == PARTITIONS // n for p in parts)
            and set().union(*parts) == set(range(PARTITIONS))
            and all(d > 0 for d in done)
        )

    return check


async def collect_all(
    settings: Settings, records: list[Any], timeout_s: float, read_committed: bool = False
) -> Collected:
    return await collect(
        settings, set(), timeout_s=timeout_s, settle_s=2.0, read_committed=read_committed,
        until=lambda g: _ids(records) <= {r["task_id"] for r in g.results + g.dead_letters},
    )  # fmt: skip


@pytest.fixture
def group_settings(make_settings: Any, simulator: SimulatorServer) -> Callable[..., Settings]:
    def make(**overrides: Any) -> Settings:
        kafka = {"partitions": PARTITIONS, "session_timeout_s": 6, "commit_interval_s": 0.2,
                 **overrides.pop("kafka", {})}  # fmt: skip
        return make_settings(
            llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1",
                 **overrides.pop("llm", {})},
            batch={"size": 50, "concurrency": 8},
            kafka=kafka,
            **overrides,
        )  # fmt: skip

    return make


@pytest.mark.parametrize("guarantee", ["at_least_once", "exactly_once"])
async def test_three_workers_split_the_partitions_and_take_over_from_a_killed_one(
    group_settings: Any, simulator: SimulatorServer, tmp_path: Path, guarantee: str
) -> None:
    simulator.sim.config.latency_ms, simulator.sim.config.latency_dist = 200, "fixed"
    settings = group_settings(processing_guarantee=guarantee)
    records = _tasks(3000, "s")
    where = await _produce(settings, records)
    group = Group(settings, 3, tmp_path).start()
    try:
        # All three in the group, four partitions each, each answering its own.
        await wait_until(group, split_evenly(settings.topics.tasks, 3), timeout_s=120,
                         what="three workers sharing the partitions")  # fmt: skip
        victim = group.workers[1]
        victim_parts = owned(await victim.scrape(), settings.topics.tasks)
        answered_at_kill = simulator.sim.snapshot()["by_status"].get("200", 0)
        victim.kill()
        assert answered_at_kill < len(records) * 0.8, "the kill came too late to matter"
        # The two survivors take over the victim's partitions, six each.
        await wait_until(group, split_evenly(settings.topics.tasks, 2), timeout_s=120,
                         what="two survivors sharing all partitions")  # fmt: skip
        got = await collect_all(settings, records, timeout_s=240,
                                read_committed=guarantee == "exactly_once")  # fmt: skip
        assert all(w.alive() for w in group.workers if w is not victim), group.logs()
    finally:
        group.stop()
    assert not got.dead_letters, got.dead_letters[:3]
    assert_one_outcome_each(got, _ids(records), where)
    if guarantee == "exactly_once":  # the victim's unfinished writes were aborted
        assert len(got.results) == len(records), len(got.results) - len(records)
    taken_over = {r["source"]["partition"] for r in got.results} & victim_parts
    assert taken_over == victim_parts


async def _standby_settled(worker: WorkerProcess, partitions: int) -> float:
    """Wait until `worker` stands by for `partitions` partitions and its standbys have read
    nothing new for 3 s (they follow within a commit interval); the records they read."""
    seen, still_since = -1.0, time.monotonic()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        scrape = await worker.scrape()
        read = scrape.value("llm_streams_store_standby_records_total")
        standing = scrape.value("llm_streams_store_standby_partitions")
        if read != seen or standing != partitions:
            seen, still_since = read, time.monotonic()
        elif read > 0 and time.monotonic() - still_since >= 3.0:
            return read
        await asyncio.sleep(0.3)
    raise AssertionError(f"standbys not settled:\n{worker.log_tail()}")


async def test_a_standby_takes_over_a_killed_workers_partitions_reading_only_their_last_records(
    group_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    """store_standby_replicas=1: each of two workers follows the other's partitions into its
    disk. SIGKILLed, one worker's partitions go to the other, whose load reads only what
    its standbys had not followed yet — not the partitions' history (the case without a
    standby: test_store's worker reading everything another wrote) — and every task, old
    and new, still ends once."""
    settings = group_settings(store_standby_replicas=1)
    first, late = _tasks(1500, "w"), _tasks(40, "z")
    where = await _produce(settings, first)
    group = Group(settings, 2, tmp_path).start()
    try:
        await wait_until(group, split_evenly(settings.topics.tasks, 2), timeout_s=120,
                         what="two workers sharing the partitions")  # fmt: skip
        await collect_all(settings, first, timeout_s=240)
        victim, survivor = group.workers
        victim_parts = owned(await victim.scrape(), settings.topics.tasks)
        followed = await _standby_settled(survivor, PARTITIONS // 2)
        loaded_before = (await survivor.scrape()).value(LOADED)
        history = await _store_records(settings, victim_parts)
        victim.kill()
        where |= await _produce(settings, late)
        got = await collect_all(settings, first + late, timeout_s=240)
        assert survivor.alive(), survivor.log_tail()
        scrape = await survivor.scrape()
        assert owned(scrape, settings.topics.tasks) == set(range(PARTITIONS))
        loaded = scrape.value(LOADED) - loaded_before
    finally:
        group.stop()
    assert not got.dead_letters, got.dead_letters[:3]
    assert_one_outcome_each(got, _ids(first + late), where)
    assert history > len(first) / 3, history  # the victim's partitions hold history ...
    assert followed > 0
    # ... which the takeover did not read again: at most what came after the standby's
    # last read (nothing: the workers were idle) and the late tasks' own writes.
    assert loaded <= 3 * len(late), (loaded, history)
    assert scrape.value("llm_streams_store_standby_partitions") == 0


async def test_a_broker_restart_mid_run_loses_no_task(
    group_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    simulator.sim.config.latency_ms, simulator.sim.config.latency_dist = 200, "fixed"
    with ApacheKafka(heap_mb=512) as kafka:
        settings = group_settings(kafka={"broker_url": kafka.url})
        records = _tasks(3000, "b")
        where = await _produce(settings, records)
        group = Group(settings, 3, tmp_path).start()
        try:
            await wait_until(group, split_evenly(settings.topics.tasks, 3), timeout_s=120,
                             what="three workers sharing the partitions")  # fmt: skip
            await asyncio.to_thread(kafka.restart, down_s=5.0)  # SIGTERM, 5 s down, start
            answered_at_restart = simulator.sim.snapshot()["by_status"].get("200", 0)
            assert answered_at_restart < len(records), "the restart came after the end"
            got = await collect_all(settings, records, timeout_s=300)
            assert all(w.alive() for w in group.workers), group.logs()
        finally:
            group.stop()
    assert not got.dead_letters, got.dead_letters[:3]
    assert_one_outcome_each(got, _ids(records), where)


async def test_a_worker_started_while_the_broker_is_down_joins_once_it_is_back(
    group_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    """A pod that starts during a broker failover waits for Kafka (a line per try) instead
    of exiting at once — before, every pod restarted during an outage exited with rc=2
    and the group was gone although the broker was back seconds later."""
    with ApacheKafka(heap_mb=512) as kafka:
        settings = group_settings(kafka={"broker_url": kafka.url})
        records = _tasks(40, "w")
        where = await _produce(settings, records)
        await asyncio.to_thread(kafka.stop_node, 0)
        worker = WorkerProcess(settings, tmp_path / "worker.log").start()
        try:
            await asyncio.sleep(10)  # the broker down for 10 s while the worker starts
            assert worker.alive(), worker.log_tail()
            await asyncio.to_thread(kafka.start_node, 0)
            got = await collect_all(settings, records, timeout_s=180)
            assert worker.alive(), worker.log_tail()
            log = worker.log_tail(400)
        finally:
            worker.stop()
    assert "Kafka at start" in log and "retry" in log, log
    assert not got.dead_letters, got.dead_letters[:3]
    assert_one_outcome_each(got, _ids(records), where)


async def test_llm_unreachable_for_thirty_seconds_every_task_still_ends_once(
    group_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    simulator.sim.config.latency_ms, simulator.sim.config.latency_dist = 100, "fixed"
    settings = group_settings(llm={"task_deadline_s": 180})
    records = _tasks(3000, "o")
    where = await _produce(settings, records)
    group = Group(settings, 3, tmp_path).start()
    try:
        await wait_until(group, split_evenly(settings.topics.tasks, 3), timeout_s=120,
                         what="three workers sharing the partitions")  # fmt: skip
        await simulator.stop()  # connections refused from now on
        cut_at = time.monotonic()
        await asyncio.sleep(30)
        await simulator.start()  # same port
        assert time.monotonic() - cut_at >= 30
        got = await collect_all(settings, records, timeout_s=300)
        scrapes = await group.scrapes()
        assert len(scrapes) == 3, group.logs()
    finally:
        group.stop()
    assert_one_outcome_each(got, _ids(records), where)
    # The breaker opened on the dead endpoint, and attempts that failed while it was
    # unreachable were not charged to the tasks: a 30-s cut inside the tasks' deadline
    # costs no task, every one is answered once the endpoint is back.
    assert sum(s.value("llm_streams_breaker_transitions_total", to="open")
               for s in scrapes if s) >= 1  # fmt: skip
    assert not got.dead_letters, [d["error"] for d in got.dead_letters[:3]]
    failed = sum(s.value("llm_streams_llm_requests_total", status="error",
                         category="upstream_error") for s in scrapes if s)  # fmt: skip
    assert failed > 0  # the cut was seen


@pytest.fixture
def cluster() -> Iterator[ApacheKafka]:
    with ApacheKafka(heap_mb=512, nodes=3) as kafka:
        yield kafka


async def test_three_broker_cluster_loses_no_task_when_a_broker_dies(
    group_settings: Any, simulator: SimulatorServer, cluster: ApacheKafka, tmp_path: Path
) -> None:
    simulator.sim.config.latency_ms, simulator.sim.config.latency_dist = 200, "fixed"
    settings = group_settings(kafka={"broker_url": cluster.url, "replication_factor": 3})
    records = _tasks(3000, "r")
    where = await _produce(settings, records)
    group = Group(settings, 2, tmp_path).start()
    try:
        await wait_until(group, split_evenly(settings.topics.tasks, 2), timeout_s=120,
                         what="two workers sharing the partitions")  # fmt: skip
        await asyncio.to_thread(cluster.stop_node, 1, kill=True)  # SIGKILL one of three
        answered_at_kill = simulator.sim.snapshot()["by_status"].get("200", 0)
        assert answered_at_kill < len(records), "the kill came after the end"
        got = await collect_all(settings, records, timeout_s=300)
        assert all(w.alive() for w in group.workers), group.logs()
    finally:
        group.stop()
    assert not got.dead_letters, got.dead_letters[:3]
    assert_one_outcome_each(got, _ids(records), where)
