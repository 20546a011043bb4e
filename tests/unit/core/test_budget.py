"""Spend caps: a task at its pipeline's cap waits (never a dead letter) until the next
window, a cheaper task settling, or a larger share; nothing is reserved for a task that
never went."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import orjson
import pytest
import yaml

from streams.contract.lanes import Lane
from streams.contract.records import Source
from streams.core.budget import Budgets, SpendMark, Withdrawn
from streams.core.spend import Prices
from streams.dev.simulator import SimulatorServer
from streams.llm.openai_client import OpenAIClient
from streams.observability.metrics import Metrics
from streams.pipelines.registry import PipelineRegistry
from streams.pipelines.specs import BudgetSpec, Caps
from streams.resilience.breaker import CircuitBreaker
from streams.resilience.clock import FakeClock
from streams.resilience.guarded import GuardedClient
from streams.resilience.limiter import GroupShare, RateLimiter
from streams.resilience.router import Member, Route
from tests.conftest import MakeProcessor
from tests.fakes import FakeLLM, answer

ROOT = Path(__file__).resolve().parents[3]
HOUR = 3600.0
START = 100 * 86400.0 + 10 * HOUR  # 10:00 UTC on a day
GOOD = {"sentiment": "positive", "confidence": 0.9, "topics": ["quality"], "issues": [],
        "summary": "good", "language": "en"}  # fmt: skip


class StillClock(FakeClock):
    """A fake clock whose timers never fire: only what the test does wakes a waiter."""

    def call_later(self, seconds: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        self.slept.append(seconds)
        return asyncio.get_running_loop().call_later(10 * 365 * 86400, callback)


def gauge(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    assert value is not None, f"{name}{labels} not exported"
    return value


async def test_under_its_cap_a_task_goes_at_once_and_its_real_cost_is_booked() -> None:
    budgets = Budgets(FakeClock(START))
    hold = await budgets.hold("p", BudgetSpec(usd_per_hour=1.0), Lane.LIVE, estimate=0.3)
    hold.settle(0.1)
    hold.settle(0.1)  # once only
    assert budgets.spent("p", "all", "hour") == pytest.approx(0.1)
    metrics = budgets.metrics
    assert gauge(metrics, "llm_streams_budget_spent_usd", pipeline="p", lane="all",
                 window="hour") == pytest.approx(0.1)  # fmt: skip
    assert gauge(metrics, "llm_streams_budget_cap_usd", pipeline="p", lane="all",
                 window="hour") == 1.0  # fmt: skip


async def test_at_the_cap_tasks_wait_for_the_next_window_and_go_on_then() -> None:
    clock = FakeClock(START + 0.25 * HOUR)
    budgets = Budgets(clock)
    spec = BudgetSpec(usd_per_hour=1.0)
    (await budgets.hold("p", spec, Lane.LIVE, estimate=0.5)).settle(1.0)  # the cap, reached
    waiting = asyncio.ensure_future(budgets.hold("p", spec, Lane.LIVE, estimate=0.5))
    hold = await waiting  # the fake clock's timer: the next hour comes at once
    assert clock.now() == pytest.approx(START + HOUR)  # not a second earlier
    assert budgets.spent("p", "all", "hour") == 0.0
    hold.settle(0.4)
    assert budgets.spent("p", "all", "hour") == pytest.approx(0.4)
    assert gauge(budgets.metrics, "llm_streams_budget_waits_total", pipeline="p",
                 lane="live") == 1.0  # fmt: skip


async def test_spend_in_flight_counts_and_a_cheaper_end_lets_the_next_go() -> None:
    clock = StillClock(START)
    budgets = Budgets(clock)
    spec = BudgetSpec(usd_per_day=1.0)
    first = await budgets.hold("p", spec, Lane.LIVE, estimate=0.6)
    second = asyncio.ensure_future(budgets.hold("p", spec, Lane.LIVE, estimate=0.6))
    await asyncio.sleep(0)
    assert not second.done()  # 0.6 in flight + 0.6 would pass the cap
    assert gauge(budgets.metrics, "llm_streams_budget_waiting_tasks", pipeline="p",
                 lane="live") == 1.0  # fmt: skip
    first.settle(0.2)  # it cost less than feared: room for the second
    (await second).settle(0.3)
    assert clock.now() == START  # no window passed
    assert budgets.spent("p", "all", "day") == pytest.approx(0.5)
    assert gauge(budgets.metrics, "llm_streams_budget_waiting_tasks", pipeline="p",
                 lane="live") == 0.0  # fmt: skip


async def test_a_task_alone_goes_whatever_its_estimate_while_the_cap_is_not_reached() -> None:
    budgets = Budgets(FakeClock(START))
    spec = BudgetSpec(usd_per_hour=0.01)
    hold = await budgets.hold("p", spec, Lane.LIVE, estimate=5.0)  # never stuck behind itself
    hold.settle(0.002)
    (await budgets.hold("p", spec, Lane.LIVE, estimate=5.0)).settle(0.002)


async def test_a_lanes_own_cap_stops_that_lane_only() -> None:
    clock = FakeClock(START)
    budgets = Budgets(clock)
    spec = BudgetSpec(usd_per_day=10.0, replay=Caps(usd_per_hour=1.0))
    (await budgets.hold("p", spec, Lane.REPLAY, estimate=0.1)).settle(1.0)
    (await budgets.hold("p", spec, Lane.LIVE, estimate=0.1)).settle(0.1)  # live goes on
    assert clock.now() == START
    replay = await budgets.hold("p", spec, Lane.REPLAY, estimate=0.1)  # waits for 11:00
    assert clock.now() == pytest.approx(START + HOUR)
    replay.settle(0.1)
    assert budgets.spent("p", "all", "day") == pytest.approx(1.2)  # the day counts all three
    assert budgets.spent("p", "replay", "hour") == pytest.approx(0.1)


async def test_each_worker_holds_its_share_of_the_cap() -> None:
    group = GroupShare()
    group.assigned(1, 4)  # a quarter of the group's partitions
    clock = StillClock(START)
    budgets = Budgets(clock, group=group)
    spec = BudgetSpec(usd_per_hour=4.0)
    (await budgets.hold("p", spec, Lane.LIVE, estimate=0.1)).settle(1.0)  # its $1
    waiting = asyncio.ensure_future(budgets.hold("p", spec, Lane.LIVE, estimate=0.1))
    await asyncio.sleep(0)
    assert not waiting.done()
    group.assigned(2, 4)  # a rebalance gives it more
    budgets.changed()
    (await waiting).settle(0.1)
    assert clock.now() == START


async def test_a_waiting_task_given_away_with_its_partition_is_withdrawn() -> None:
    budgets = Budgets(StillClock(START))
    spec = BudgetSpec(usd_per_hour=1.0)
    (await budgets.hold("p", spec, Lane.LIVE, estimate=0.1)).settle(1.0)
    owned = True
    waiting = asyncio.ensure_future(
        budgets.hold("p", spec, Lane.LIVE, estimate=0.1, owned=lambda: owned)
    )
    await asyncio.sleep(0)
    owned = False
    budgets.changed()
    with pytest.raises(Withdrawn):
        await waiting


async def test_a_task_cancelled_while_waiting_reserves_nothing() -> None:
    clock = StillClock(START)
    budgets = Budgets(clock)
    spec = BudgetSpec(usd_per_day=1.0)
    first = await budgets.hold("p", spec, Lane.LIVE, estimate=0.9)
    waiting = asyncio.ensure_future(budgets.hold("p", spec, Lane.LIVE, estimate=0.5))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    first.settle(0.9)
    assert gauge(budgets.metrics, "llm_streams_budget_waiting_tasks", pipeline="p",
                 lane="live") == 0.0  # fmt: skip
    # Nothing of the cancelled one in flight: a small task still fits under the cap.
    (await budgets.hold("p", spec, Lane.LIVE, estimate=0.05)).settle(0.05)
    assert clock.now() == START


def _budgeted(tmp_path: Path, budget: dict[str, object]) -> PipelineRegistry:
    spec = yaml.safe_load((ROOT / "pipelines" / "comment-analysis.yaml").read_text())
    spec["budget"] = budget
    (tmp_path / "comment-analysis.yaml").write_text(yaml.safe_dump(spec))
    return PipelineRegistry.load(tmp_path, ROOT / "schemas")


def _task(i: int) -> bytes:
    return orjson.dumps({"task_id": f"t{i}", "pipeline": "comment-analysis",
                         "input": {"text": f"Great phone, number {i}."}})  # fmt: skip


async def test_a_pipeline_at_its_cap_holds_its_tasks_back_without_a_dead_letter(
    tmp_path: Path, make_processor: MakeProcessor
) -> None:
    llm = FakeLLM(lambda _r: answer(GOOD, prompt_tokens=1000, completion_tokens=100))
    processor = make_processor(
        llm, registry=_budgeted(tmp_path, {"usd_per_hour": 0.002}),
        prices=Prices(prompt_per_1k=0.001, completion_per_1k=0.002), deadline_s=1,
    )  # fmt: skip
    clock = processor.budgets.clock = FakeClock(START)
    src = Source(topic="t", partition=0, offset=0)
    outs = [await processor.process(_task(i), f"t{i}".encode(), src) for i in range(2)]
    # $0.0012 each: the second goes alone under the cap, as a task alone does.
    assert [o.kind for o in outs] == ["result", "result"]
    assert clock.now() == START
    third = await processor.process(_task(2), b"t2", src)  # $0.0024 spent: waits for 11:00
    assert third.kind == "result" and third.attempts == 1  # its deadline began after the wait
    assert clock.now() == pytest.approx(START + HOUR)
    assert len(llm.requests) == 3
    assert processor.budgets.spent("comment-analysis", "all", "hour") == pytest.approx(0.0012)


async def test_a_cap_raised_while_tasks_wait_lets_them_go_at_once() -> None:
    clock = StillClock(START)
    budgets = Budgets(clock)
    spec = BudgetSpec(usd_per_hour=1.0)
    (await budgets.hold("p", spec, Lane.LIVE, estimate=0.1)).settle(1.0)
    waiting = asyncio.ensure_future(budgets.hold("p", spec, Lane.LIVE, estimate=0.1))
    await asyncio.sleep(0)
    budgets.override({"other": BudgetSpec(usd_per_day=1.0)})  # another pipeline's: no help
    await asyncio.sleep(0)
    assert not waiting.done()
    budgets.override({"p": BudgetSpec(usd_per_hour=5.0)})  # `llm-streams budget p …`
    (await waiting).settle(0.1)
    assert clock.now() == START
    assert budgets.caps("p", spec) == BudgetSpec(usd_per_hour=5.0)
    assert budgets.spent("p", "all", "hour") == pytest.approx(1.1)  # what was spent stays
    budgets.override({})  # back to the file's
    assert budgets.caps("p", spec) is spec


def test_caps_say_themselves_in_a_line() -> None:
    spec = BudgetSpec(usd_per_day=50, replay=Caps(usd_per_hour=2.5))
    assert spec.describe() == "$50/day, replay $2.5/hour"
    assert BudgetSpec().describe() == "none"


async def test_spend_is_counted_per_partition_and_goes_on_after_a_restart() -> None:
    clock = StillClock(START)
    budgets = Budgets(clock)
    budgets.owned = lambda: {0, 1}
    spec = BudgetSpec(usd_per_day=1.0)
    (await budgets.hold("p", spec, Lane.LIVE, estimate=0.1, partition=0)).settle(0.3)
    (await budgets.hold("p", spec, Lane.LIVE, estimate=0.1, partition=1)).settle(0.4)
    saved = budgets.unsaved()
    assert {(m.partition, m.spent_usd) for m in saved} == {(0, 0.3), (1, 0.4)}
    assert budgets.unsaved() == []  # saved once
    # A restart (or the partitions' next owner): it goes on from what was saved, for the
    # partitions it owns; an old window's mark counts for nothing.
    again = Budgets(StillClock(START + 60))
    again.owned = lambda: {1}
    yesterday = replace(saved[0], index=saved[0].index - 1, spent_usd=5.0, partition=1)
    again.seed([*saved, yesterday])
    assert again.spent("p", "all", "day") == 0.0  # no cap of p held yet: nothing opened
    (await again.hold("p", spec, Lane.LIVE, estimate=0.1, partition=1)).settle(0.2)
    assert again.spent("p", "all", "day") == pytest.approx(0.6)  # p1: 0.4 saved + 0.2
    again.owned = lambda: {0, 1}  # a rebalance gives it partition 0 too
    assert again.spent("p", "all", "day") == pytest.approx(0.9)
    (await again.hold("p", spec, Lane.LIVE, estimate=0.2, partition=0)).settle(0.2)  # alone
    waiting = asyncio.ensure_future(again.hold("p", spec, Lane.LIVE, estimate=0.2, partition=0))
    await asyncio.sleep(0)
    assert not waiting.done()  # 1.1 spent today on its partitions: it waits
    waiting.cancel()


async def test_a_partitions_spend_read_back_never_lowers_what_is_counted() -> None:
    budgets = Budgets(StillClock(START))
    spec = BudgetSpec(usd_per_hour=10.0)
    (await budgets.hold("p", spec, Lane.LIVE, estimate=0.1, partition=2)).settle(0.5)
    (mark,) = budgets.unsaved()
    (await budgets.hold("p", spec, Lane.LIVE, estimate=0.1, partition=2)).settle(0.5)
    budgets.seed([mark])  # its own older save, read back: 1.0 stays
    assert budgets.spent("p", "all", "hour") == pytest.approx(1.0)


async def test_with_saved_spend_no_capped_task_goes_before_it_is_read() -> None:
    budgets = Budgets(StillClock(START), saved=True)
    spec = BudgetSpec(usd_per_day=1.0)
    early = asyncio.ensure_future(budgets.hold("p", spec, Lane.LIVE, estimate=0.1, partition=0))
    await asyncio.sleep(0)
    assert not early.done()
    # What an earlier run saved, read back: the cap is reached already.
    budgets.seed([SpendMark("p", "all", "day", 0, int(START // 86400), 1.0)])
    budgets.synced()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not early.done()  # read, and at the cap: it waits for tomorrow
    early.cancel()


async def test_a_deployment_at_its_cap_takes_no_call_while_another_has_room() -> None:
    """A deployment's own caps (LiteLLM's per-deployment `max_budget`) count what every
    pipeline's calls to it cost; at its cap the route leaves it out until its window
    ends; its spend is saved and read back like a pipeline's."""
    clock = StillClock(START)
    budgets = Budgets(clock)
    budgets.cap_deployments({"east": Caps(usd_per_hour=1.0), "west": Caps(usd_per_day=5.0),
                             "free": Caps()})  # fmt: skip
    budgets.book({"east": 0.6, "west": 0.1, "": 0.3}, partition=0)
    assert budgets.deployment_wait("east") == 0.0
    budgets.book({"east": 0.5}, partition=1)  # $1.1 this hour: at its cap
    assert budgets.deployment_wait("east") == pytest.approx(HOUR)  # until 11:00
    assert budgets.deployment_wait("west") == 0.0 and budgets.deployment_wait("free") == 0.0
    east, west = (GuardedClient(FakeLLM(), limiter=RateLimiter(rpm=6000),
                                breaker=CircuitBreaker(n), deployment=n)
                  for n in ("east", "west"))  # fmt: skip
    route = Route("m", [Member("east", east, capped=partial(budgets.deployment_wait, "east")),
                        Member("west", west, capped=partial(budgets.deployment_wait, "west"))],
                  seed=1)  # fmt: skip
    assert {route.pick().deployment for _ in range(50)} == {"west"}
    saved = budgets.unsaved()
    assert {(m.pipeline, m.window, m.partition, m.spent_usd) for m in saved} == {
        ("deployment:east", "hour", 0, 0.6), ("deployment:east", "hour", 1, 0.5),
        ("deployment:west", "day", 0, 0.1)}  # fmt: skip
    again = Budgets(StillClock(START + 60))  # a restart, within the hour
    again.cap_deployments({"east": Caps(usd_per_hour=1.0)})
    again.seed(saved)
    assert again.deployment_wait("east") == pytest.approx(HOUR - 60)
    clock.advance(HOUR)
    assert budgets.deployment_wait("east") == 0.0  # the next hour: it takes calls again
    assert {route.pick().deployment for _ in range(50)} == {"east", "west"}


async def test_when_every_deployment_of_a_model_is_at_its_cap_its_tasks_wait() -> None:
    clock = FakeClock(START + 0.5 * HOUR)
    budgets = Budgets(clock)
    budgets.cap_deployments({"east": Caps(usd_per_hour=1.0), "west": Caps(usd_per_hour=1.0)})
    held = await budgets.deployments_room("p", ["east", "west"], Lane.LIVE, 0.1)  # at once
    assert held is not None and clock.now() == START + 0.5 * HOUR
    held.settle(0.0)
    budgets.book({"east": 1.0, "west": 2.0}, partition=0)
    await budgets.deployments_room("p", ["east", "west"], Lane.LIVE, 0.1)
    assert clock.now() == pytest.approx(START + HOUR)  # the fake clock's timer: 11:00
    assert gauge(budgets.metrics, "llm_streams_budget_waits_total", pipeline="p",
                 lane="live") == 1.0  # fmt: skip
    budgets.book({"east": 1.0, "west": 1.0}, partition=0)
    budgets.owned = lambda: {0}
    with pytest.raises(Withdrawn):
        await budgets.deployments_room("p", ["east", "west"], Lane.LIVE, 0.1,
                                       owned=lambda: False)  # fmt: skip
    uncapped = await budgets.deployments_room("p", ["east", "free"], Lane.LIVE, 0.1)
    assert uncapped is not None  # a deployment without caps takes it: no wait


async def test_the_models_tasks_in_flight_count_against_what_its_deployments_have_left() -> None:
    """Spend is booked when a task ends: without what the tasks in flight may cost, every
    record the worker holds went at once past a cap (30 of 30, on a worker)."""
    clock = StillClock(START)
    budgets = Budgets(clock)
    budgets.cap_deployments({"east": Caps(usd_per_hour=1.0), "west": Caps(usd_per_hour=1.0)})
    names = ["east", "west"]
    first = await budgets.deployments_room("p", names, Lane.LIVE, 0.8)
    second = await budgets.deployments_room("p", names, Lane.LIVE, 0.8)
    third = asyncio.ensure_future(budgets.deployments_room("p", names, Lane.LIVE, 0.8))
    await asyncio.sleep(0)
    assert first is not None and second is not None and not third.done()  # 2.4 > 2.0 left
    budgets.book({"east": 0.3}, partition=0)
    first.settle(0.0)  # it cost less than feared: room for the third
    assert (await third) is not None
    alone = Budgets(StillClock(START))
    alone.cap_deployments({"east": Caps(usd_per_hour=1.0)})
    assert await alone.deployments_room("p", ["east"], Lane.LIVE, 5.0) is not None  # alone


async def test_a_task_ended_while_waiting_at_its_pipelines_cap_gives_back_its_deployment_room(
    tmp_path: Path, make_processor: MakeProcessor
) -> None:
    """The deployments' room is taken before the pipeline's wait: a task cancelled (or
    withdrawn) in that wait kept it, and the model's later tasks waited behind a task
    that was gone."""
    llm = FakeLLM(lambda _r: answer(GOOD, prompt_tokens=1000, completion_tokens=100))
    processor = make_processor(
        llm, registry=_budgeted(tmp_path, {"usd_per_hour": 0.001}),
        prices=Prices(prompt_per_1k=0.001, completion_per_1k=0.002), deadline_s=1,
    )  # fmt: skip
    budgets = processor.budgets
    budgets.clock = StillClock(START)
    names = [m.name for m in processor.calls.route_for("gpt-4o-mini").members]
    budgets.cap_deployments({name: Caps(usd_per_hour=1.0) for name in names})
    src = Source(topic="t", partition=0, offset=0)
    first = await processor.process(_task(0), b"t0", src)  # alone: goes, $0.0012 > $0.001
    assert first.kind == "result"
    waiting = asyncio.ensure_future(processor.process(_task(1), b"t1", src))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not waiting.done()  # at the pipeline's cap, holding its deployments' room
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    whole = asyncio.ensure_future(budgets.deployments_room("other", names, Lane.LIVE,
                                                           len(names) * 1.0 - 0.0012))  # fmt: skip
    await asyncio.sleep(0)
    assert whole.done() and whole.result() is not None  # nothing left reserved
    assert len(llm.requests) == 1


async def test_calls_that_got_no_answer_count_their_prompts_against_the_cap(
    tmp_path: Path, simulator: SimulatorServer, make_processor: MakeProcessor
) -> None:
    """A server that hangs reports no usage, though a hosted provider may finish a call
    its client left and bill it: the task cost $0 and a cap never stopped a slow
    provider's retries. The prompts sent are said on the letter, and counted."""
    simulator.sim.config.update({"hang_rate": 1.0, "hang_s": 30})
    client = OpenAIClient(base_url=simulator.base_url, api_key="k", connect_timeout_s=1,
                          read_timeout_s=0.2)  # fmt: skip
    processor = make_processor(
        client, registry=_budgeted(tmp_path, {"usd_per_hour": 0.05}),
        prices=Prices(prompt_per_1k=1.0, completion_per_1k=1.0), deadline_s=5,
    )  # fmt: skip
    processor.budgets.clock = StillClock(START)
    src = Source(topic="t", partition=0, offset=0)
    try:
        dead = await processor.process(_task(0), b"t0", src)
    finally:
        await client.close()
    letter = dead.record()
    assert dead.kind == "dead_letter" and letter["error"]["category"] == "timeout"
    assert letter["attempts"] == 3 and letter["cost_usd"] == 0.0  # no usage reported
    sent = letter["unanswered_prompt_tokens"]
    assert sent > 0 and sent % 3 == 0  # the same prompt, three times
    assert gauge(processor.client.metrics, "llm_streams_unanswered_prompt_tokens_total",
                 deployment="default") == sent  # fmt: skip
    spent = processor.budgets.spent("comment-analysis", "all", "hour")
    assert spent == pytest.approx(sent / 1000)  # at the prompt price, past the $0.05 cap
    waiting = asyncio.ensure_future(processor.process(_task(1), b"t1", src))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not waiting.done()  # held at the cap: no fourth call to the hanging server
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert simulator.sim.snapshot()["by_outcome"].get("hang", 0) == 3


async def test_a_deployments_cap_set_while_the_workers_run_replaces_its_files() -> None:
    budgets = Budgets(StillClock(START))
    budgets.cap_deployments({"east": Caps(usd_per_hour=1.0)})
    budgets.book({"east": 1.5, "west": 1.5}, partition=0)  # west: no cap, nothing counted
    assert budgets.deployment_wait("east") > 0 and budgets.deployment_wait("west") == 0
    budgets.override({"deployment:east": BudgetSpec(usd_per_hour=10.0),
                      "deployment:west": BudgetSpec(usd_per_day=1.0)})  # fmt: skip
    assert budgets.deployment_wait("east") == 0.0  # raised: $1.5 of $10
    budgets.book({"west": 1.5}, partition=0)
    assert budgets.deployment_wait("west") > 0  # a cap where its file has none
    budgets.override({})  # back to the file's
    assert budgets.deployment_wait("east") > 0 and budgets.deployment_wait("west") == 0
