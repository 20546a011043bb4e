"""End to end on a real Kafka broker: every record ends as exactly one result or dead letter."""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import jsonschema
import orjson
import pytest

from streams.dev.simulator import SimulatorServer
from tests.integration.helpers import Scrape, WorkerProcess, collect, produce

pytestmark = pytest.mark.integration

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"


def _task(i: int) -> dict[str, Any]:
    text = random.Random(i).choice(
        ["Love it, excellent quality!", "Arrived late and the box was crushed.",
         "快递太慢了，包装也破了。", "ok", "质量很好，非常满意！", "Broke after a week. Refund please."]
    )  # fmt: skip
    return {
        "task_id": f"t-{i:05d}",
        "pipeline": "comment-analysis",
        "input": {"text": f"{text} #{i}"},
    }


# One of every kind of bad record, each with what its dead letter must say.
POISON_KINDS: list[tuple[str, bytes | None, str]] = [
    ("not_json", b"{not json", "not_json"),
    ("array", b'[1, 2, 3]', "not_an_object"),
    ("string", b'"hello"', "not_an_object"),
    ("missing_task_id", b'{"pipeline": "comment-analysis", "input": {"text": "hi"}}', "invalid_input"),
    ("empty_task_id", b'{"task_id": "", "pipeline": "comment-analysis", "input": {"text": "hi"}}', "invalid_input"),
    ("missing_pipeline", b'{"task_id": "x", "input": {"text": "hi"}}', "invalid_input"),
    ("empty_input", b'{"task_id": "x", "pipeline": "comment-analysis", "input": {}}', "invalid_input"),
    ("wrong_type", b'{"task_id": "x", "pipeline": "comment-analysis", "input": "text"}', "invalid_input"),
    ("unknown_pipeline", b'{"task_id": "x", "pipeline": "nope", "input": {"text": "hi"}}', "unknown_pipeline"),
    ("missing_slot", b'{"task_id": "x", "pipeline": "comment-analysis", "input": {"body": "hi"}}', "missing_slot"),
    ("slot_type", b'{"task_id": "x", "pipeline": "comment-analysis", "input": {"text": 42}}', "slot_type"),
    ("too_large", None, "too_large"),
    ("tombstone", None, "empty_record"),
]  # fmt: skip


def _poison(kind: str, payload: bytes | None, n: int) -> bytes | None:
    if kind == "too_large":
        return orjson.dumps(
            {"task_id": f"big-{n}", "pipeline": "comment-analysis", "input": {"text": "x" * 70_000}}
        )
    if kind == "tombstone":
        return None
    assert payload is not None
    return payload.replace(b'"x"', f'"p-{n}"'.encode())


async def test_poison_records_and_valid_tasks_each_end_exactly_once(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    settings = make_settings(
        llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1"},
        batch={"size": 50, "window_s": 0.05, "concurrency": 32},
    )
    rng = random.Random(42)
    records: list[tuple[bytes | None, bytes | None]] = []
    kinds: list[str | None] = []
    for i in range(950):
        task = _task(i)
        records.append((task["task_id"].encode(), orjson.dumps(task)))
        kinds.append(None)
    for n in range(50):  # 5% poison, every kind several times
        kind, payload, _ = POISON_KINDS[n % len(POISON_KINDS)]
        records.append((f"poison-{n}".encode(), _poison(kind, payload, n)))
        kinds.append(kind)
    order = list(range(len(records)))
    rng.shuffle(order)
    records = [records[i] for i in order]
    kinds = [kinds[i] for i in order]

    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        offsets = await produce(settings, records)
        got = await collect(settings, set(offsets), timeout_s=180, worker=worker)
        metrics = await worker.scrape()
    finally:
        worker.stop()

    by_source: dict[tuple[int, int], list[tuple[str, dict[str, Any]]]] = defaultdict(list)
    for r in got.results:
        by_source[(r["source"]["partition"], r["source"]["offset"])].append(("result", r))
    for d in got.dead_letters:
        by_source[(d["source"]["partition"], d["source"]["offset"])].append(("dead", d))

    assert set(by_source) == set(offsets), f"missing: {len(set(offsets) - set(by_source))}"
    result_schema = orjson.loads((SCHEMAS / "result.schema.json").read_bytes())
    dl_schema = orjson.loads((SCHEMAS / "dead-letter.schema.json").read_bytes())
    expected_codes = {k: code for k, _, code in POISON_KINDS}
    for (key, value), kind, where in zip(records, kinds, offsets, strict=True):
        outcomes = by_source[where]
        assert len(outcomes) == 1, f"{key!r} at {where} ended {len(outcomes)} times"
        what, record = outcomes[0]
        if kind is None:
            assert what == "result", record
            jsonschema.validate(record, result_schema)
            task = orjson.loads(value or b"")
            assert record["task_id"] == task["task_id"]
            assert record["output"]["sentiment"] in {"positive", "negative", "neutral", "mixed"}
        else:
            assert what == "dead", record
            jsonschema.validate(record, dl_schema)
            assert record["error"]["category"] == "invalid_input"
            assert record["error"]["retryable"] is False
            assert record["attempts"] == 0
            if expected_codes[kind] != "invalid_input":
                assert record["error"]["code"] == expected_codes[kind], record["error"]
            assert record["error"]["message"]
            if value is not None and kind not in ("not_json",):
                assert record["payload"] == orjson.loads(value)
            if kind == "not_json":
                assert "raw_base64" in record["payload"]
    # Each valid task has exactly one result key, and no simulator call was wasted on poison.
    keys_by_task: dict[str, set[str]] = defaultdict(set)
    for r in got.results:
        keys_by_task[r["task_id"]].add(r["result_key"])
    assert len(keys_by_task) == 950
    assert all(len(k) == 1 for k in keys_by_task.values())
    assert simulator.sim.snapshot()["by_status"] == {"200": 950}
    # The worker's own account agrees with what it wrote.
    assert metrics.value("llm_streams_tasks_received_total", lane="live") == 1000
    assert metrics.value("llm_streams_tasks_completed_total", outcome="result") == 950
    assert metrics.value("llm_streams_tasks_completed_total", outcome="dead_letter") == 50
    assert metrics.value("llm_streams_dead_letters_total", category="invalid_input") == 50
    assert metrics.value("llm_streams_llm_requests_total", status="ok") == 950
    assert metrics.value("llm_streams_llm_requests_total", status="error") == 0
    assert metrics.value("llm_streams_tasks_in_flight") == 0
    assert metrics.value("llm_streams_tasks_unfinished") == 0
    assert metrics.value("llm_streams_end_to_end_seconds_count") == 1000
    assert metrics.value("llm_streams_batch_size_sum") == 1000
    versions = "llm_streams_prompt_versions_total"
    assert metrics.value(versions, version="v1", chosen_by="default") == 950
    assert "task_id" not in metrics.text and "t-00001" not in metrics.text  # bounded labels


async def _run_tasks(
    settings: Any, tmp_path: Path, n: int
) -> tuple[list[dict[str, Any]], Any, Scrape]:
    tasks = [_task(i) for i in range(n)]
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        offsets = await produce(settings, [(t["task_id"].encode(), orjson.dumps(t)) for t in tasks])
        got = await collect(settings, set(offsets), timeout_s=240, worker=worker)
        metrics = await worker.scrape()
    finally:
        worker.stop()
    ended = Counter(r["task_id"] for r in got.results) + Counter(
        d["task_id"] for d in got.dead_letters
    )
    assert set(ended) == {t["task_id"] for t in tasks}
    assert all(n == 1 for n in ended.values()), [t for t, n in ended.items() if n > 1]
    return tasks, got, metrics


async def test_5xx_and_malformed_output_are_retried_or_dead_lettered(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    cfg = simulator.sim.config
    cfg.error_500_rate = 0.15
    cfg.error_503_rate = 0.05
    cfg.malformed_rate = 0.15
    settings = make_settings(
        llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1",
             "max_attempts": 4, "backoff_base_s": 0.05, "backoff_max_s": 0.5},
        batch={"size": 50, "concurrency": 32},
    )  # fmt: skip
    tasks, got, metrics = await _run_tasks(settings, tmp_path, 400)

    stats = simulator.sim.snapshot()
    assert stats["by_outcome"]["error_500"] > 0 and stats["by_outcome"]["error_503"] > 0
    assert stats["by_outcome"]["malformed"] > 0
    # A task fails only if all 4 attempts fail (~1.5%) or two answers are malformed (~2%).
    assert len(got.results) > 0.8 * len(tasks)
    assert any(r["attempts"] > 1 for r in got.results)
    for d in got.dead_letters:
        assert d["error"]["category"] in {"upstream_error", "invalid_output"}, d
        assert d["error"]["retryable"] is True
        if d["error"]["category"] == "invalid_output":
            assert 2 <= d["attempts"] <= 4, d  # one repair retry, then it gives up
        else:
            assert d["attempts"] == 4, d  # max_attempts
    # Retries and failed calls are paid for: the results carry the tokens of every answer.
    assert sum(r["usage"]["prompt_tokens"] for r in got.results) <= stats["prompt_tokens"]

    # /metrics counts every fault the simulator injected, and what each cost.
    out = stats["by_outcome"]
    errors = "llm_streams_llm_requests_total"
    assert metrics.value(errors, status="error", category="upstream_error") == (
        out["error_500"] + out["error_503"]
    )
    assert metrics.value(errors, status="ok") == stats["by_status"]["200"]
    bad_answers = out["malformed"] + out.get("truncated", 0)
    assert metrics.value("llm_streams_outputs_total", verdict="fail") == bad_answers
    dead = Counter(d["error"]["category"] for d in got.dead_letters)
    for category in ("upstream_error", "invalid_output"):
        assert metrics.value("llm_streams_dead_letters_total", category=category) == dead[category]
    # Every failed attempt is retried unless it was the task's last one.
    assert metrics.value("llm_streams_retries_total") == (
        out["error_500"] + out["error_503"] + bad_answers - len(got.dead_letters)
    )
    assert metrics.value("llm_streams_tasks_completed_total", outcome="result") == len(got.results)
    # Cost = tokens x the price table (defaults: $0.00015 / $0.0006 per 1k).
    prompt = metrics.value("llm_streams_tokens_total", kind="prompt")
    completion = metrics.value("llm_streams_tokens_total", kind="completion")
    assert prompt == stats["prompt_tokens"] and completion == stats["completion_tokens"]
    assert metrics.value("llm_streams_cost_usd_total") == pytest.approx(
        prompt * 0.00015 / 1000 + completion * 0.0006 / 1000, rel=1e-6
    )


async def test_unknown_rate_limit_is_learned_without_a_429_storm(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    simulator.sim.config.rpm = 1200  # 20/s, bursts of 20; the worker is not told
    settings = make_settings(
        llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1",
             "max_attempts": 4, "backoff_base_s": 0.05, "backoff_max_s": 0.5},
        batch={"size": 50, "concurrency": 32},
    )  # fmt: skip
    tasks, got, metrics = await _run_tasks(settings, tmp_path, 300)

    stats = simulator.sim.snapshot()
    # Only the first burst, sent before any answer carried x-ratelimit headers, may be
    # refused; after that the limiter holds the worker to 20/s.
    assert stats["by_status"].get("429", 0) <= 32, stats
    assert len(got.results) == len(tasks), [d["error"] for d in got.dead_letters][:3]
    assert stats["by_status"]["200"] == len(tasks)
    # Each 429 is counted, cut the limiter's rate, and was retried.
    refused = stats["by_status"].get("429", 0)
    assert metrics.value("llm_streams_llm_requests_total", category="rate_limited") == refused
    assert metrics.value("llm_streams_limiter_throttled_total") == refused
    assert metrics.value("llm_streams_retries_total", category="rate_limited") == refused
    # The limiter learned the provider's 1,200/min from its headers.
    learned = metrics.value("llm_streams_limiter_rate_per_minute", unit="requests")
    assert 0 < learned <= 1200
