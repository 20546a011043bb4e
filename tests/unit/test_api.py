"""The Python API on the simulator: a task in, its result or dead letter out; the shipped
Faust example builds."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import faust

from streams.api import Analyzer
from streams.dev.simulator import SimulatorServer
from streams.settings import load_settings

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
