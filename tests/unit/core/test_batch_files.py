"""A finished batch's files as the batch lane keeps them: read once however many jobs
ask, looked up by custom_id without copying, and kept within a byte budget — a replay
following many 50,000-line files holds a bounded amount of memory, not every file
parsed (before: 64 files by count, ~140 MB each once parsed)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from streams.core.batch import BatchLane
from streams.core.batch.files import BatchFiles, index_lines
from streams.llm.client import LLMRequest
from streams.settings import BatchApiSettings
from tests.unit.core.test_batches import LedgerStore, QuickClock

ROOT = Path(__file__).resolve().parents[3]
LINES = 50_000  # a provider's largest batch file


def _answer(custom_id: str, text: str) -> dict[str, Any]:
    body = {"id": "c", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 20, "completion_tokens": 10}}  # fmt: skip
    return {"id": f"r-{custom_id}", "custom_id": custom_id,
            "response": {"status_code": 200, "body": body}, "error": None}  # fmt: skip


class BigBatches:
    """A provider whose every batch's output file has 50,000 lines (~15 MB): the batch's
    own requests and, to make up the size, answers to requests of other batches."""

    def __init__(self, per_batch: int) -> None:
        self.uploads: dict[str, bytes] = {}
        self.batches: dict[str, dict[str, Any]] = {}
        self.reads = 0
        filler = orjson.dumps(_answer("other-{}", "x" * 40))
        self.padding = b"".join(filler.replace(b"{}", str(i).encode()) + b"\n"
                                for i in range(LINES - per_batch))  # fmt: skip

    async def upload_batch_file(self, data: bytes, name: str) -> str:
        file_id = f"in-{len(self.uploads)}"
        self.uploads[file_id] = data
        return file_id

    async def create_batch(self, input_file_id: str, metadata: dict[str, str]) -> dict[str, Any]:
        batch_id = f"batch-{len(self.batches)}"
        self.batches[batch_id] = {"id": batch_id, "status": "completed", "metadata": metadata,
                                  "output_file_id": f"out-{input_file_id}",
                                  "error_file_id": None, "created_at": 0}  # fmt: skip
        return self.batches[batch_id]

    async def retrieve_batch(self, batch_id: str) -> dict[str, Any]:
        return self.batches[batch_id]

    async def list_batches(self, after: str | None = None, limit: int = 100) -> list[Any]:
        return []

    async def file_content(self, file_id: str) -> bytes:
        self.reads += 1
        lines = [orjson.loads(x) for x in self.uploads[file_id.removeprefix("out-")].splitlines()]
        ours = b"".join(orjson.dumps(_answer(x["custom_id"], f"answer {x['custom_id']}")) + b"\n"
                        for x in lines)  # fmt: skip
        return ours + self.padding  # the provider's bytes: one copy per read


def _request(i: int) -> LLMRequest:
    return LLMRequest(messages=[{"role": "user", "content": f"comment {i}"}], model="m",
                      params={"max_tokens": 50})  # fmt: skip


BUDGET = 32 * 1024 * 1024


async def replay_over_big_files() -> dict[str, Any]:
    """Forty requests in eight batches, each batch's output file 50,000 lines: the lane's
    figures and its process's resident memory before and at its peak (this runs in a
    process of its own, so the peak is this replay's)."""
    settings = BatchApiSettings(linger_s=0.01, poll_s=0.01, poll_max_s=0.05, max_items=5,
                                intake_per_s=100_000, files_cache_bytes=BUDGET)  # fmt: skip
    ops = BigBatches(per_batch=5)
    lane = BatchLane(ops, LedgerStore(), settings, clock=QuickClock())  # type: ignore[arg-type]
    ops.uploads["probe"] = orjson.dumps({"custom_id": "probe"})
    file_bytes = len(await ops.file_content("out-probe"))  # one file's size, read now
    ops.reads = 0
    before = _rss_kib()
    try:
        answers = await asyncio.gather(*(
            lane.complete(0, f"rk-{i}", 1, _request(i)) for i in range(40)
        ))  # fmt: skip
    finally:
        await lane.close()
    return {
        "answers": [a.content for a in answers], "batches": len(ops.batches),
        "reads": ops.reads, "file_bytes": file_bytes,
        "kept_bytes": lane.files.kept_bytes, "before_kib": before,
        "peak_kib": _status_kib("VmHWM"),
    }  # fmt: skip


def _rss_kib() -> int:
    return _status_kib("VmRSS")


def _status_kib(field: str) -> int:
    """A figure of this process's own memory (`VmHWM`: its peak resident set — not
    getrusage's, which on Linux keeps the parent's peak across the exec)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(f"{field}:"))


def test_a_replay_over_many_50000_line_files_holds_a_bounded_memory() -> None:
    code = ("import asyncio, json; from tests.unit.core.test_batch_files import "
            "replay_over_big_files as r; print(json.dumps(asyncio.run(r())))")  # fmt: skip
    # Large blocks always mapped and given back when freed: resident memory is then what
    # is alive, not what glibc kept of freed blocks (its dynamic mmap threshold otherwise
    # moves 16 MB blocks onto the heap, and the peak depends on the order of frees).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, check=True, env=env)  # fmt: skip
    got = orjson.loads(done.stdout.splitlines()[-1])
    assert got["answers"] == [f"answer rk-{i}" for i in range(40)]
    assert got["batches"] == 8 and got["reads"] == 8  # each file read once
    file_bytes, grew = got["file_bytes"], (got["peak_kib"] - got["before_kib"]) * 1024
    print(
        f"8 batches of {LINES:,}-line files ({file_bytes / 2**20:.1f} MiB each, "
        f"{8 * file_bytes / 2**20:.0f} MiB in all): resident memory grew by "
        f"{grew / 2**20:.0f} MiB at its peak, with a {BUDGET / 2**20:.0f} MiB budget"
    )
    # The budget, the files of the two batches in use (each its bytes and index), and the
    # allocator's slack: ~67 MiB here, the CPU loaded or not. Every file kept parsed, as
    # before, grew by 766 MiB on the same files.
    assert grew < BUDGET + 4 * file_bytes, got
    assert got["kept_bytes"] <= max(BUDGET, file_bytes * 1.5)


async def test_a_file_is_read_once_for_every_job_that_asks_and_kept_by_bytes() -> None:
    reads: list[str] = []

    async def read(file_id: str) -> bytes:
        reads.append(file_id)
        await asyncio.sleep(0.01)
        return b"".join(orjson.dumps({"custom_id": f"{file_id}-{i}", "n": i}) + b"\n"
                        for i in range(100))  # fmt: skip

    files = BatchFiles(read, max_bytes=20_000)
    got = await asyncio.gather(*(files.get("a") for _ in range(10)))
    assert reads == ["a"] and all(g is got[0] for g in got)
    assert got[0].get("a-7") == {"custom_id": "a-7", "n": 7}
    assert got[0].get("b-7") is None
    one = got[0].size  # ~3 KB of lines + their index
    await files.get("b")
    await files.get("c")  # over 20,000 bytes with a, b and c? then a goes first
    kept = files.kept_bytes
    assert kept <= max(20_000, one)
    await files.get("a")
    assert reads.count("a") == (1 if 3 * one <= 20_000 else 2)


async def test_lines_without_a_custom_id_are_left_out_and_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    raw = b'{"custom_id": "a", "x": 1}\n\n{not json\n{"no_id": 1}\n{"custom_id": "b"}'
    starts = await index_lines(raw, "file-1")
    assert sorted(starts) == ["a", "b"]
    assert "2 line(s) without a readable custom_id" in caplog.text
