"""What a batch's end hands out, at the lane's intake pace: each answer to the job
waiting on it, and each job parked on the batch its run again (see `core.batch`).

A batch of 50 000 answers ending at once would otherwise wake 50 000 jobs that all
write results in the same second; both queues drain at `intake_per_s`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

from aiolimiter import AsyncLimiter

from streams.core.batch.ledger import JOB_PREFIX, Ledger, job_key
from streams.core.batch.parking import Resume
from streams.llm.client import LLMResponse


class Handout:
    """Answers and resumed jobs, one at a time at `intake_per_s`."""

    def __init__(
        self, ledger: Ledger, intake_per_s: float, spawn: Callable[[Any], asyncio.Task[Any]]
    ) -> None:
        self.ledger = ledger
        self.resume: Resume | None = None  # the edge's, to run parked jobs again
        self._spawn = spawn
        self._pace = AsyncLimiter(max(1.0, intake_per_s / 10), 0.1)
        self._answers: asyncio.Queue[tuple[asyncio.Future[Any], LLMResponse]] = asyncio.Queue()
        self._answering: asyncio.Task[None] | None = None
        self._resumes: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
        self._resuming: asyncio.Task[None] | None = None

    def answer(self, future: asyncio.Future[Any], answer: LLMResponse) -> None:
        """`future` gets `answer` in its turn (unless it is done by then)."""
        self._answers.put_nowait((future, answer))
        if self._answering is None or self._answering.done():
            self._answering = self._spawn(self._answer_paced())

    def resume_jobs(self, partition: int, keys: Iterable[str]) -> None:
        """The jobs parked under `keys` in `partition` run again, if the partition is still
        this worker's (otherwise its new owner resumes them)."""
        if self.resume is None or not self.ledger.owns(partition):
            return
        for key in dict.fromkeys(keys):
            if self.ledger.get(partition, job_key(key)) is not None:
                self._resumes.put_nowait((partition, key))
        self._start_resuming()

    def resume_partition(self, partition: int) -> None:
        """Every job parked in `partition`'s ledger runs again."""
        for key in self.ledger.keys(partition, JOB_PREFIX):
            self._resumes.put_nowait((partition, key[len(JOB_PREFIX) :].decode()))
        self._start_resuming()

    def _start_resuming(self) -> None:
        if not self._resumes.empty() and (self._resuming is None or self._resuming.done()):
            self._resuming = self._spawn(self._resume_paced())

    async def _resume_paced(self) -> None:
        while not self._resumes.empty():
            partition, key = self._resumes.get_nowait()
            async with self._pace:
                record = self.ledger.get(partition, job_key(key))
                if record is not None and self.resume is not None and self.ledger.owns(partition):
                    self.resume(partition, key, record)

    async def _answer_paced(self) -> None:
        while not self._answers.empty():
            future, answer = self._answers.get_nowait()
            if future.done():
                continue
            async with self._pace:
                if not future.done():
                    future.set_result(answer)


__all__ = ["Handout"]
