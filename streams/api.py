"""The Python API: the worker's processing, from your own code.

    from streams.api import Analyzer

    async with Analyzer() as analyzer:  # the settings of the environment, like the worker
        outcome = await analyzer.analyze({"task_id": "c-1", "pipeline": "comment-analysis",
                                          "input": {"text": "The zip broke after two days."}})
        outcome.kind          # "result" or "dead_letter"
        outcome.key           # the result key the worker would write it under
        outcome.record()      # the result (or dead letter) record, as the worker writes it

An `Analyzer` holds what the worker holds per process: the pipelines, one rate
limiter and breaker per endpoint and model, retries, fallbacks, the deadline,
validation and the metrics. A task of a session (a version with `session:`) gets
the session's earlier turns in its prompt, as in the worker: the analyzer keeps
them in memory (`SessionTurns`: the least recently used sessions go first beyond
`max_sessions`) and runs one turn of a session at a time, in the order asked. It
never raises for a task: bad input and provider failures come back as dead letters,
as in the worker. It writes nothing: what to do with the outcome (a topic, a table)
is the caller's. `examples/faust_app.py` uses it inside a Faust agent.

The worker builds its processor where the API does (`streams.assembly`), so the two
cannot drift: the same task gives the same result key and the same output.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import orjson

from streams.assembly import SourceReader, processor_factory
from streams.contract.headers import Headers
from streams.contract.lanes import Lane
from streams.contract.records import Source
from streams.core.outcome import Outcome
from streams.core.processor import TaskProcessor
from streams.errors import ConfigError, InvalidInput, TaskError
from streams.observability.metrics import Metrics
from streams.pipelines.registry import PipelineRegistry
from streams.pipelines.sources import Erase, Skipped
from streams.settings import Settings, load_settings

log = logging.getLogger(__name__)

# Where a task given to the API comes from, when the caller does not say.
API_SOURCE = Source(topic="api", partition=0, offset=0)


class SessionTurns:
    """The turns of an `Analyzer`'s sessions, in memory: what the worker keeps in its
    task store's sessions map. At most `max_sessions` sessions and `max_bytes` of turns
    (a session's turns are bounded by its version's `max_turns` alone), the least
    recently used dropped first (a dropped session's next turn starts without history).
    Subclass it (`get`, `put`) to keep them elsewhere."""

    def __init__(self, max_sessions: int = 10_000, max_bytes: int = 64 * 1024 * 1024) -> None:
        if max_sessions < 1 or max_bytes < 1:
            raise ValueError("max_sessions and max_bytes must be at least 1")
        self.max_sessions, self.max_bytes = max_sessions, max_bytes
        self._turns: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        # One turn of a session at a time: a lock per session while a turn holds or
        # awaits it, dropped with the last (so locks never outnumber turns in flight).
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    def get(self, session: str) -> bytes | None:
        found = self._turns.get(session)
        if found is not None:
            self._turns.move_to_end(session)
        return found

    def put(self, session: str, turns: bytes) -> None:
        self._bytes += len(turns) - len(self._turns.get(session, b""))
        self._turns[session] = turns
        self._turns.move_to_end(session)
        while len(self._turns) > self.max_sessions or self._bytes > self.max_bytes:
            self._bytes -= len(self._turns.popitem(last=False)[1])

    @property
    def kept(self) -> list[str]:
        """The sessions whose turns are kept, least recently used first."""
        return list(self._turns)

    @property
    def kept_bytes(self) -> int:
        """Bytes of turns kept, bounded by `max_bytes`."""
        return self._bytes

    @property
    def busy(self) -> set[str]:
        """Sessions with a turn running or waiting for one: no other holds a lock."""
        return set(self._locks)

    @asynccontextmanager
    async def turn(self, session: str) -> AsyncIterator[None]:
        """Held while one turn of `session` runs."""
        lock, users = self._locks.get(session, (asyncio.Lock(), 0))
        self._locks[session] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[session]
            if users == 1:
                del self._locks[session]
            else:
                self._locks[session] = (lock, users - 1)


class Analyzer:
    """The worker's processing for tasks you hand it (see the module's docstring)."""

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        registry: PipelineRegistry | None = None,
        metrics: Metrics | None = None,
        sessions: SessionTurns | None = None,
    ) -> None:
        self.settings = settings or load_settings()
        self.registry = registry or PipelineRegistry.load(
            self.settings.pipelines_dir, self.settings.schemas_dir
        )
        self.metrics = metrics or Metrics()
        self._make = processor_factory(self.settings, self.registry, self.metrics)
        self.reader = SourceReader(self.settings, self.metrics)
        self.sessions = sessions or SessionTurns()
        self._positions = itertools.count(1)  # a session's turns, in the order asked
        self._processor: TaskProcessor | None = None

    @property
    def processor(self) -> TaskProcessor:
        if self._processor is None:  # made in the caller's event loop, on first use
            self._processor = self._make()
        return self._processor

    async def analyze(
        self,
        task: Mapping[str, Any] | bytes,
        *,
        key: bytes | None = None,
        source: Source | None = None,
        lane: Lane = Lane.LIVE,
    ) -> Outcome:
        """One task (a mapping in record contract v1, or a record's raw value) answered:
        its result or its dead letter. `key`: the record's key, if it had one; `source`:
        where it came from (it goes in the result, and into nothing else)."""
        source = source or API_SOURCE
        if isinstance(task, bytes):
            return await self._answer(task, key, source, lane)
        try:
            raw = orjson.dumps(dict(task))
        except TypeError as exc:  # a set, a key not a string, an integer past 64 bits
            bad = InvalidInput(f"task is not JSON: {exc}", code="not_json")
            task_id = task.get("task_id")
            hint = key or (task_id.encode() if isinstance(task_id, str) else None)
            return self.processor.dead_letter(bad, None, hint, source)
        return await self._answer(raw, key, source, lane)

    async def _answer(self, raw: bytes, key: bytes | None, source: Source, lane: Lane) -> Outcome:
        processor = self.processor
        session = processor.intake.session_hint(raw)
        if session is None:
            return await processor.process(raw, key, source, lane)
        async with self.sessions.turn(session):
            prep = processor.intake.prepare(raw, key, source, history=self.sessions.get,
                                     position=next(self._positions))  # fmt: skip
            if isinstance(prep, Outcome):
                return prep
            outcome = await processor.answer(prep, lane)
            if outcome.output is not None and prep.session is not None:
                turns = prep.session_turns(self.sessions.get(prep.session), outcome.output)
                if turns is not None:
                    self.sessions.put(prep.session, turns)
            return outcome

    async def analyze_record(
        self,
        pipeline: str,
        value: bytes | None,
        *,
        key: bytes | None = None,
        headers: Headers | None = None,
        timestamp: float | None = None,
        source: Source | None = None,
        lane: Lane = Lane.LIVE,
    ) -> Outcome | Skipped | Erase:
        """A record of one of `pipeline`'s source topics (its `source:` mapping, decoded
        with the schema registry if the source says so) answered; or why it is skipped
        (its filter, a tombstone); or, for a source with `erase:`, the task a delete
        upstream deletes (what the caller keeps of it is the caller's to erase). A record
        that cannot be mapped is a dead letter."""
        mapper = self.registry.get(pipeline).source
        if mapper is None:
            raise ConfigError(f"pipeline {pipeline} declares no `source:` mapping")
        source = source or API_SOURCE
        [(_, task)] = await self.reader.tasks([mapper], value, key, headers, timestamp)
        if isinstance(task, TaskError):
            return self.processor.dead_letter(task, value, key, source)
        if isinstance(task, Skipped | Erase):
            return task
        task_key = str(task["task_id"]).encode()
        return await self._answer(orjson.dumps(task), task_key, source, lane)

    async def close(self) -> None:
        await self.reader.close()
        if self._processor is not None:
            await self._processor.close()
            self._processor = None

    async def __aenter__(self) -> Analyzer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


__all__ = ["API_SOURCE", "Analyzer", "SessionTurns"]
