"""Sessions on real Kafka: three conversations of five turns, interleaved with other
tasks. Each turn after the first carries the earlier turns (seen in the simulator's
requests), trimmed to the budget in the stated order; a conversation keeps one version
of a 50/50 split; a replay of the sessions sends the same prompts."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from streams.core.sessions import messages_of
from streams.dev.simulator import SimulatorServer
from streams.llm.tokens import count_messages
from tests.integration.helpers import WorkerProcess, collect, produce, run_cli

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
# Turns 1 and 3 are complaints: their answers list issues, which marks them.
TURNS = ["Hello, I bought a blender.", "The lid arrived broken.",
         "Thanks for the quick reply.", "Can I get a refund?", "Also the box was fine."]  # fmt: skip
SENTIMENT = ["neutral", "negative", "neutral", "negative", "neutral"]  # the simulator's labels


def turn_cost(i: int, session: str) -> int:
    turn = {"input": {"text": said(session, i)}, "output": {"sentiment": SENTIMENT[i]}}
    return count_messages(messages_of(turn)) - 3


def said(session: str, i: int) -> str:
    return f"{TURNS[i]} ({session})"


def sessions_pipeline(directory: Path, budget: int) -> None:
    data = yaml.safe_load((ROOT / "pipelines" / "comment-analysis.yaml").read_text())
    session = {"budget_tokens": budget, "mark": ["issues"],
               "keep": {"slots": ["text"], "fields": ["sentiment"]}}  # fmt: skip
    v1 = dict(data["versions"]["v1"], session=session)
    data["versions"] = {"v1": v1, "v2": dict(v1, system=v1["system"] + "Be brief.\n")}
    data["traffic"] = {"v1": 0.5, "v2": 0.5}
    data.pop("chunking", None)
    directory.mkdir()
    (directory / "comment-analysis.yaml").write_text(yaml.safe_dump(data, allow_unicode=True))


def context_of_turn(chats: list[list[dict[str, Any]]], text: str) -> list[list[str]]:
    """For each request whose last user message is `text`: the earlier user messages."""
    found = []
    for messages in chats:
        users = [str(m.get("content")) for m in messages if m.get("role") == "user"]
        if users and text in users[-1]:
            found.append([u for u in users[:-1]])
    return found


async def test_turns_carry_their_sessions_history_within_the_budget(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    sessions = ["s-alpha", "s-beta", "s-gamma"]
    costs = sorted(turn_cost(i, s) for s in sessions for i in range(5))
    budget = costs[-1] + costs[-2]  # any two turns fit, never three
    assert budget < costs[0] + costs[1] + costs[2]
    sessions_pipeline(tmp_path / "pipelines", budget)
    settings = make_settings(
        llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1"},
        pipelines_dir=tmp_path / "pipelines", schemas_dir=ROOT / "schemas",
    )  # fmt: skip
    records: list[tuple[bytes | None, bytes | None]] = []
    for i in range(5):  # interleaved: turn i of each session, then an unrelated task
        for s in sessions:
            records.append((s.encode(), orjson.dumps({
                "task_id": f"{s}-{i}", "pipeline": "comment-analysis", "session_id": s,
                "input": {"text": said(s, i)}})))  # fmt: skip
        records.append((f"other-{i}".encode(), orjson.dumps({
            "task_id": f"other-{i}", "pipeline": "comment-analysis",
            "input": {"text": f"Unrelated comment {i}, great product."}})))  # fmt: skip
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        offsets = await produce(settings, records)
        got = await collect(settings, set(offsets), timeout_s=120, worker=worker)
        live = list(simulator.sim.chats)
        simulator.sim.chats.clear()
        replayed = await asyncio.to_thread(run_cli, settings, "replay", "--from-offset", "0:0",
                                           "--from-offset", "1:0", "--from-offset", "2:0",
                                           "--from-offset", "3:0", "--force")  # fmt: skip
        assert replayed.returncode == 0, replayed.stderr
        for _ in range(240):  # every replayed task asked again
            if len(simulator.sim.chats) >= len(live):
                break
            await asyncio.sleep(0.5)
        again = list(simulator.sim.chats)
        simulator.sim.chats.clear()
        rerun = await asyncio.to_thread(run_cli, settings, "backtrack", "s-beta-4", "--rerun")
        assert rerun.returncode == 0, rerun.stderr
        for _ in range(120):
            if simulator.sim.chats:
                break
            await asyncio.sleep(0.5)
        backtracked = list(simulator.sim.chats)
    finally:
        worker.stop()
    assert not got.dead_letters, got.dead_letters
    by_session: dict[str, set[str]] = {}
    for r in got.results:
        if r["task_id"].startswith("s-"):
            by_session.setdefault(r["task_id"].rsplit("-", 1)[0], set()).add(r["prompt_version"])
    assert set(by_session) == set(sessions)
    assert all(len(v) == 1 for v in by_session.values()), by_session  # one version each

    # Priority: the last turn, then the marked (complaints: 1 and 3), then the newest;
    # two fit the budget; the ones chosen in the order they happened.
    expected = {1: [0], 2: [0, 1], 3: [1, 2], 4: [1, 3]}
    for s in sessions:
        (first,) = context_of_turn(live, said(s, 0))
        assert first == []
        for i, earlier in expected.items():
            (got_context,) = context_of_turn(live, said(s, i))
            assert got_context == [said(s, j) for j in earlier], (s, i)
    others = [c for t in range(5) for c in context_of_turn(live, f"Unrelated comment {t},")]
    assert others == [[]] * 5  # tasks outside a session carry nothing

    # The replay sent each turn's prompt again, the same as live; so did a backtrack.
    assert sorted(orjson.dumps(m) for m in again) == sorted(orjson.dumps(m) for m in live)
    (rerun_prompt,) = backtracked
    assert rerun_prompt in live and context_of_turn([rerun_prompt], said("s-beta", 4)) == [
        [said("s-beta", 1), said("s-beta", 3)]]  # fmt: skip
