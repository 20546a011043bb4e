"""A worker whose model has a small context window answers long comments in chunks:
end to end on Kafka, each long comment ends as one merged, valid result."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from streams.dev.simulator import SimulatorServer
from tests.integration.helpers import WorkerProcess, assert_one_outcome_each, collect, produce

pytestmark = pytest.mark.integration


def _long(i: int) -> str:
    fine = [f"Part {k} of blender {i} works fine and looks nice." for k in range(50)]
    fine[7] = "The delivery was late by a week."
    fine[44] = "The packaging was crushed and the lid broke."
    return " ".join(fine)


async def test_long_comments_are_chunked_and_merged_end_to_end(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    simulator.sim.config.context_window = 1200  # the provider refuses what does not fit
    settings = make_settings(llm={"base_url": simulator.base_url, "api_key": "k",
                                  "model": "sim-1", "context_window": 1200})  # fmt: skip
    tasks = [{"task_id": f"long-{i}", "pipeline": "comment-analysis", "input": {"text": _long(i)}}
             for i in range(5)]  # fmt: skip
    tasks += [{"task_id": f"short-{i}", "pipeline": "comment-analysis",
               "input": {"text": f"Fine ({i})."}} for i in range(5)]  # fmt: skip
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        offsets = await produce(settings, [(t["task_id"].encode(), orjson.dumps(t)) for t in tasks])
        got = await collect(settings, set(offsets), timeout_s=120, worker=worker)
        metrics = await worker.scrape()
    finally:
        worker.stop()
    assert_one_outcome_each(got, {t["task_id"] for t in tasks})
    assert not got.dead_letters, got.dead_letters[:2]
    stats = simulator.sim.snapshot()
    assert stats["by_outcome"].get("context_overflow", 0) == 0  # nothing sent too long
    chunks = metrics.value("llm_streams_chunks_total", pipeline="comment-analysis")
    assert chunks >= 10 and stats["requests"] == chunks + 5  # 5 short ones in one call each
    assert metrics.value("llm_streams_mitigations_total", kind="chunk") == 5
    for r in got.results:
        if r["task_id"].startswith("long-"):
            evidence = {i["evidence"] for i in r["output"]["issues"]}
            assert any("delivery" in e for e in evidence), r["output"]
            assert any("packaging" in e for e in evidence), r["output"]
            assert r["attempts"] >= 2
