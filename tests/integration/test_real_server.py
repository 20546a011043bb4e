"""The worker against a real model server nobody here wrote: llama.cpp's own HTTP server
(the `xllamacpp` wheel) serving SmolLM2-135M-Instruct (streams.dev.llamacpp), 2 slots of
1,024 tokens each, an API key, no rate-limit headers — on Apache Kafka.

What only a real server shows: its window and slots said by itself (not assumed), its
structured-output modes honoured or not, its own refusals, and a saturated server that
is not taken for a failing one. The model is too small for the shipped schema: these
tests use one it can answer (real_server/tiny.yaml)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from streams.dev.llamacpp import MODEL_NAME, LlamaServer
from tests.integration.helpers import (
    WorkerProcess,
    assert_one_outcome_each,
    collect,
    produce,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent / "real_server"
MODES = ("json_schema", "json_object", "schema_in_prompt", "tool_call")
TEXTS = ["I love this blender, it works great.", "The zip broke after two days. Terrible.",
         "Great value and fast delivery!", "It stopped working, I want a refund."]  # fmt: skip
# Neither the worker's fault nor the task's: none may end a task against a healthy server.
NEVER = {"bad_request", "timeout", "circuit_open", "deadline_exceeded", "upstream_error"}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    log = tmp_path_factory.mktemp("llama") / "server.log"
    with LlamaServer(ctx=2048, parallel=2, api_key="test-key", log_file=log) as server:
        yield server


def _pipelines(tmp_path: Path, modes: tuple[str, ...]) -> tuple[Path, Path]:
    pipelines, schemas = tmp_path / "pipelines", tmp_path / "schemas"
    pipelines.mkdir()
    shutil.copytree(ROOT / "schemas", schemas)
    shutil.copy(HERE / "tiny-sentiment.output.schema.json", schemas)
    text = (HERE / "tiny.yaml").read_text()
    for mode in modes:
        (pipelines / f"tiny-{mode}.yaml").write_text(text.replace("MODE", mode))
    return pipelines, schemas


def _task(task_id: str, pipeline: str, text: str) -> tuple[bytes, bytes]:
    body = {"task_id": task_id, "pipeline": pipeline, "input": {"text": text}}
    return task_id.encode(), orjson.dumps(body)


def _settings(make_settings: Any, llama: LlamaServer, tmp_path: Path, modes: tuple[str, ...],
              **llm: Any) -> Any:  # fmt: skip
    pipelines, schemas = _pipelines(tmp_path, modes)
    return make_settings(
        llm={"base_url": llama.base_url, "api_key": "test-key", "model": MODEL_NAME,
             "task_deadline_s": 300, **llm},
        pipelines_dir=pipelines, schemas_dir=schemas,
    )  # fmt: skip


async def test_every_mode_and_a_comment_over_the_window_end_every_task_once(
    make_settings: Any, llama: LlamaServer, tmp_path: Path
) -> None:
    """Each structured-output mode the shipped pipelines may use, and a comment three
    times the server's 1,024-token window: every task one result or one dead letter, none
    of them the worker's or the server's fault; json_schema (a grammar) answers every task;
    the long comment is chunked to the window the server said, not refused as a bad
    request; a forced tool call answered as content is counted."""
    settings = _settings(make_settings, llama, tmp_path, MODES)
    records = [_task(f"{mode}-{i}", f"tiny-{mode}", text)
               for mode in MODES for i, text in enumerate(TEXTS)]  # fmt: skip
    long_text = " ".join(f"The kettle part {i} rattles and the lid broke." for i in range(330))
    records.append(_task("long-1", "tiny-json_schema", long_text))
    task_ids = {k.decode() for k, _ in records}
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        await produce(settings, records)
        got = await collect(settings, set(), timeout_s=420, worker=worker, settle_s=2.0,
                            until=lambda g: task_ids <= {r["task_id"] for r in
                                                         g.results + g.dead_letters})  # fmt: skip
        scrape = await worker.scrape()
    finally:
        worker.stop()
    assert_one_outcome_each(got, task_ids)
    categories = {d["error"]["category"] for d in got.dead_letters}
    assert not categories & NEVER, [d["error"] for d in got.dead_letters]
    answered = {r["task_id"] for r in got.results}
    assert {f"json_schema-{i}" for i in range(len(TEXTS))} | {"long-1"} <= answered, [
        (d["task_id"], d["error"]) for d in got.dead_letters
    ]
    assert scrape.value("llm_streams_mitigations_total", kind="chunk") >= 1
    assert scrape.value("llm_streams_structured_output_degraded_total", mode="tool_call") >= 1
    by_mode = {m: sum(1 for r in got.results if r["pipeline"] == f"tiny-{m}") for m in MODES}
    print(f"results per mode (of {len(TEXTS)}): {by_mode}")


async def test_a_saturated_real_server_is_not_taken_for_a_failing_one(
    make_settings: Any, llama: LlamaServer, tmp_path: Path
) -> None:
    """32 tasks at once at a server of 2 slots, with a read timeout a queued request would
    outlive (before: 64 in flight, calls timed out in the server's queue, its finished
    work thrown away, retried, the breaker opened on a healthy server). The worker takes
    the 2 slots the server says it has: no call times out, nothing fails, the breaker
    never opens, every task is answered."""
    settings = _settings(make_settings, llama, tmp_path, ("json_schema",), read_timeout_s=4)
    records = [_task(f"s-{i}", "tiny-json_schema", f"{TEXTS[i % 4]} (order {i})")
               for i in range(32)]  # fmt: skip
    task_ids = {k.decode() for k, _ in records}
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        await produce(settings, records)
        got = await collect(settings, set(), timeout_s=420, worker=worker, settle_s=1.0,
                            until=lambda g: task_ids <= {r["task_id"] for r in
                                                         g.results + g.dead_letters})  # fmt: skip
        scrape = await worker.scrape()
        log = worker.log_tail(400)
    finally:
        worker.stop()
    assert "(llama.cpp), model smollm2, window 1024 (said), 2 slots" in log, log  # its banner
    assert_one_outcome_each(got, task_ids)
    assert {r["task_id"] for r in got.results} == task_ids, got.dead_letters[:3]
    assert scrape.value("llm_streams_llm_requests_total", status="error") == 0
    assert scrape.value("llm_streams_breaker_transitions_total", to="open") == 0
    # It took the server's 2 slots and one ready (the limit below 3 only where calls were
    # measured queueing at the server: on a loaded host, a CPU shared with the server
    # and the broker, that happens and takes it down to 1; in a full run once, alone never).
    assert "3 calls at once (was 1): the server has 2 slots" in log, log
    assert 1 <= scrape.value("llm_streams_endpoint_concurrency") <= 4, log  # never the 64
    lowered = [line for line in log.splitlines() if "calls at once" in line
               and "the server has" not in line]  # fmt: skip
    assert all("calls queue at the server" in line for line in lowered), lowered


async def test_a_wrong_key_and_a_dead_endpoint_are_said_clearly(llama: LlamaServer) -> None:
    from streams.api import Analyzer
    from streams.settings import load_settings

    task = {"task_id": "k-1", "pipeline": "comment-analysis", "input": {"text": "Fine."}}
    wrong = load_settings(llm={"base_url": llama.base_url, "api_key": "wrong",
                               "model": MODEL_NAME})  # fmt: skip
    async with Analyzer(wrong) as analyzer:
        outcome = await asyncio.wait_for(analyzer.analyze(task), 60)
    error = outcome.record()["error"]
    assert outcome.kind == "dead_letter" and error["category"] == "auth", error
    assert "Invalid API Key" in error["message"]
