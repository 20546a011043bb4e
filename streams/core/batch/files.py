"""A finished batch's output and error files as the batch lane reads them: each file
downloaded once however many jobs ask meanwhile, indexed by custom_id, and kept while
the files kept fit a byte budget (the least recently used go first).

A provider's batch file holds up to 50,000 lines (~50 MB); parsed into dicts, one
takes ~140 MB, and a replay follows dozens of batches. Kept as its bytes with the
offset of each custom_id's line, a file costs its size plus ~100 bytes a line, a
lookup parses one line (O(1), no copy of the file's index), and the budget bounds
them all: memory is at most the budget (or the one largest file, kept even when it
alone is over it) plus the files of the `IN_USE` batches being read or answered from
at a time (`in_use`: held from the download until the answers are out, so that files
downloaded and not yet used never pile up, however slow the loop). No library keeps a
byte-bounded LRU of indexed files with single-flight reads (cachetools bounds by count
or a size function, without the single flight or the asynchronous read), hence this
module.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

log = logging.getLogger(__name__)

# Batches whose files are read or answered from at once (each may hold two files).
IN_USE = 2
# What one indexed line costs beside its bytes: its custom_id, the offset and the slot.
INDEX_BYTES_PER_LINE = 100
# Lines indexed between two turns of the event loop (the consumer shares the loop).
LINES_PER_TURN = 2_000


class BatchFile:
    """One file's bytes and where each custom_id's line starts."""

    def __init__(self, raw: bytes, starts: dict[str, int]) -> None:
        self.raw = raw
        self.starts = starts
        self.size = len(raw) + INDEX_BYTES_PER_LINE * len(starts)

    def get(self, custom_id: str) -> dict[str, Any] | None:
        start = self.starts.get(custom_id)
        if start is None:
            return None
        end = self.raw.find(b"\n", start)
        line: dict[str, Any] = orjson.loads(memoryview(self.raw)[start : end if end >= 0 else None])
        return line


class BatchLines:
    """A batch's lines by custom_id: its output file's, else its error file's."""

    def __init__(self, *files: BatchFile | None) -> None:
        self.files = [f for f in files if f is not None]

    def get(self, custom_id: str) -> dict[str, Any] | None:
        for file in self.files:
            line = file.get(custom_id)
            if line is not None:
                return line
        return None


NO_LINES = BatchLines()


async def index_lines(raw: bytes, name: str = "") -> dict[str, int]:
    """Where each custom_id's line starts. A line that is not a JSON object with a
    custom_id is left out (its request then has no answer in this batch), and said."""
    starts: dict[str, int] = {}
    view = memoryview(raw)
    unreadable = 0
    pos, n = 0, 0
    while pos < len(raw):
        end = raw.find(b"\n", pos)
        end = len(raw) if end < 0 else end
        if end > pos and raw[pos:end].strip():
            try:
                starts[str(orjson.loads(view[pos:end])["custom_id"])] = pos
            except (orjson.JSONDecodeError, KeyError, TypeError):
                unreadable += 1
        pos, n = end + 1, n + 1
        if n % LINES_PER_TURN == 0:
            await asyncio.sleep(0)
    if unreadable:
        log.warning("batch file %s: %d line(s) without a readable custom_id left out", name,
                    unreadable)  # fmt: skip
    return starts


class BatchFiles:
    """Batch files by id, read through `read(file_id)`, kept within `max_bytes`."""

    def __init__(
        self,
        read: Callable[[str], Awaitable[bytes]],
        max_bytes: int,
        spawn: Callable[[Awaitable[BatchFile]], asyncio.Task[BatchFile]] | None = None,
    ) -> None:
        self._read = read
        self.max_bytes = max_bytes
        self._spawn = spawn or asyncio.ensure_future
        self._kept: OrderedDict[str, BatchFile] = OrderedDict()
        self.kept_bytes = 0
        self._reading: dict[str, asyncio.Task[BatchFile]] = {}
        self._in_use = asyncio.Semaphore(IN_USE)
        self.downloads = 0  # files read from the provider, for the metrics and tests

    async def get(self, file_id: str) -> BatchFile:
        kept = self._kept.get(file_id)
        if kept is not None:
            self._kept.move_to_end(file_id)
            return kept
        reading = self._reading.get(file_id)
        if reading is None:  # one download, however many jobs ask meanwhile
            reading = self._reading[file_id] = self._spawn(self._fetch(file_id))
        return await asyncio.shield(reading)

    async def lines(self, output_file_id: str | None, error_file_id: str | None) -> BatchLines:
        """A batch's lines (the output file's win over the error file's)."""
        output = await self.get(output_file_id) if output_file_id else None
        errors = await self.get(error_file_id) if error_file_id else None
        return BatchLines(output, errors)

    def in_use(self) -> asyncio.Semaphore:
        """Held while a batch's files are read and answered from (`async with`)."""
        return self._in_use

    async def _fetch(self, file_id: str) -> BatchFile:
        try:
            raw = await self._read(file_id)
            self.downloads += 1
            file = BatchFile(raw, await index_lines(raw, file_id))
            self._keep(file_id, file)
            return file
        finally:
            self._reading.pop(file_id, None)

    def _keep(self, file_id: str, file: BatchFile) -> None:
        self._kept[file_id] = file
        self.kept_bytes += file.size
        while self.kept_bytes > self.max_bytes and len(self._kept) > 1:
            _, old = self._kept.popitem(last=False)
            self.kept_bytes -= old.size


__all__ = ["NO_LINES", "BatchFile", "BatchFiles", "BatchLines", "index_lines"]
