"""Replay: send a historical range of a task topic again, through the replay lane.

A replay reads `[start, end)` of each partition of a source topic (from times
with `offsets_for_times`, or explicit offsets), and republishes each task into
the replay topic, tagged with the replay id and the record it came from. A task
whose result key is already in the results topic is skipped — so a replay
under a new prompt version (new keys) re-analyses everything, and running the
same replay twice sends nothing twice — unless `force` asks for a fresh answer.

Resumable: the replay's plan and progress are checkpointed in a compacted
topic (`<app_id>-replays`, keyed by replay id) after each acked chunk. The id
is derived from the arguments, so running the same command again after a kill
continues where the last checkpoint stopped (at most one chunk is sent again,
and the worker answers those from the task store without a call).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime

import orjson
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.structs import ConsumerRecord

from streams.contract.headers import (
    ERASE_HEADER,
    FORCE_HEADER,
    REPLAY_ID_HEADER,
    REPLAY_OF_HEADER,
    TIER_HEADER,
)
from streams.contract.lanes import Tier
from streams.contract.records import EraseRequest, decode_task, json_object, now_iso, result_key
from streams.core.spend import Prices
from streams.errors import ConfigError, TaskError
from streams.kafka import clients
from streams.kafka.clients import partitions_of, reader
from streams.kafka.publisher import Sends
from streams.kafka.scan import end_offsets, scan
from streams.kafka.topics import ensure_topics, replays_topic
from streams.llm.client import completion_budget
from streams.llm.tokens import count_messages
from streams.pipelines.registry import PipelineRegistry
from streams.pipelines.render import PipelineVersion
from streams.settings import Settings

log = logging.getLogger(__name__)

CHUNK = 500  # records between checkpoints
DEFAULT_COMPLETION_TOKENS = 200  # estimate when no earlier result and no max_tokens


@dataclass(frozen=True)
class ReplayRequest:
    """What the user asked for (the CLI's arguments)."""

    source: str
    since: datetime | None = None
    until: datetime | None = None
    from_offsets: dict[int, int] = field(default_factory=dict)
    pipeline: str | None = None
    prompt_version: str | None = None
    force: bool = False
    tier: str | None = None  # sync | flex | batch; None: the pipeline's lane policy
    # What the run may cost in all, estimated before each task is sent (not in the id: the
    # same replay run again with a higher budget goes on where it stopped).
    budget_usd: float | None = None

    def replay_id(self) -> str:
        """Same arguments, same id: a second run resumes the first."""
        parts = [
            self.source,
            self.since.isoformat() if self.since else "",
            self.until.isoformat() if self.until else "",
            ",".join(f"{p}:{o}" for p, o in sorted(self.from_offsets.items())),
            self.pipeline or "",
            self.prompt_version or "",
            "force" if self.force else "",
        ]
        return "rp-" + hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:16]


@dataclass
class Counts:
    read: int = 0
    published: int = 0
    answered: int = 0  # skipped: result key already in the results topic
    stale: int = 0  # of `answered`: by an earlier definition of its version (edited since)
    filtered: int = 0  # skipped: another pipeline than asked
    invalid: int = 0  # skipped: not a valid task (its dead letter exists already)
    refused: int = 0  # not sent: the replay topic or the producer refused it for good
    erased: int = 0  # skipped: an erase request for the task came after its record
    prompt_tokens: int = 0
    completion_tokens: float = 0.0  # estimated
    estimated_usd: float = 0.0  # of what was sent, each task at the price of its tier

    def unsent(self, n: int) -> None:
        """`n` records counted as published were refused for good."""
        self.published -= n
        self.refused += n

    def cost_usd(self, settings: Settings, tier: str = "sync") -> float:
        """Estimated cost at the sync price, or at the batch price (batch and flex)."""
        prices = Prices.from_settings(settings)
        return prices.estimate(self.prompt_tokens, self.completion_tokens, Tier(tier))


@dataclass
class Checkpoint:
    replay_id: str
    source: str
    start: dict[int, int]
    end: dict[int, int]
    next: dict[int, int]
    counts: Counts
    done: bool = False
    updated_at: str = ""
    # Stopped before the task that would have taken the estimate past the budget.
    at_budget: bool = False

    @property
    def total(self) -> int:
        return sum(max(0, self.end[p] - self.start[p]) for p in self.end)

    @property
    def progressed(self) -> int:
        return sum(max(0, min(self.next[p], self.end[p]) - self.start[p]) for p in self.end)

    def dumps(self) -> bytes:
        return orjson.dumps(
            asdict(self) | {"updated_at": now_iso()}, option=orjson.OPT_NON_STR_KEYS
        )

    @classmethod
    def loads(cls, raw: bytes) -> Checkpoint:
        data = orjson.loads(raw)

        def ints(d: dict[str, int]) -> dict[int, int]:
            return {int(k): int(v) for k, v in d.items()}

        known = set(Counts.__dataclass_fields__)  # a newer version's extra counts: left out
        return cls(
            replay_id=data["replay_id"],
            source=data["source"],
            start=ints(data["start"]),
            end=ints(data["end"]),
            next=ints(data["next"]),
            counts=Counts(**{k: v for k, v in data["counts"].items() if k in known}),
            done=bool(data["done"]),
            updated_at=data.get("updated_at", ""),
            at_budget=bool(data.get("at_budget", False)),
        )


async def resolve_range(
    settings: Settings, request: ReplayRequest
) -> tuple[dict[int, int], dict[int, int]]:
    """Per partition of the source, the first offset to replay and the one to stop at."""
    parts = await partitions_of(settings, request.source)
    if not parts:
        raise ConfigError(f"source topic {request.source!r} does not exist or has no partitions")
    unknown = set(request.from_offsets) - set(parts)
    if unknown:
        raise ConfigError(f"--from-offset names partitions {sorted(unknown)} that "
                          f"{request.source!r} does not have (it has {parts})")  # fmt: skip
    consumer = reader(settings, "replay-plan")
    await consumer.start()
    try:
        tps = [TopicPartition(request.source, p) for p in parts]
        ends = {tp.partition: o for tp, o in (await end_offsets(consumer, tps)).items()}
        starts = {tp.partition: o for tp, o in (await consumer.beginning_offsets(tps)).items()}

        async def at(when: datetime) -> dict[int, int]:
            ms = int(when.timestamp() * 1000)
            found = await consumer.offsets_for_times(dict.fromkeys(tps, ms))
            # None: no record at or after that time in the partition.
            return {tp.partition: (o.offset if o is not None else ends[tp.partition])
                    for tp, o in found.items()}  # fmt: skip

        start: dict[int, int] = {}
        since = await at(request.since) if request.since else None
        for p in parts:
            if p in request.from_offsets:
                start[p] = max(request.from_offsets[p], starts[p])
            elif since is not None:
                start[p] = since[p]
            else:  # only --from-offset given, and not for this partition
                start[p] = ends[p]
        end = await at(request.until) if request.until else dict(ends)
        return start, {p: max(start[p], end[p]) for p in parts}
    finally:
        await consumer.stop()


@dataclass
class Answered:
    """What the results topic holds: its result keys, and (completion tokens, results)
    per (pipeline, prompt version) and per (pipeline, None), for cost estimates."""

    keys: set[bytes] = field(default_factory=set)
    usage: dict[tuple[str, str | None], tuple[int, int]] = field(default_factory=dict)
    # Of `keys`: answered by an earlier definition of their version than the pipeline
    # files' now (its `prompt_digest` another: the version edited in place since).
    stale: set[bytes] = field(default_factory=set)

    def completion_estimate(self, pipeline: str, version: str) -> float | None:
        """The mean completion of the version's results, else of the pipeline's."""
        for k in ((pipeline, version), (pipeline, None)):
            if k in self.usage:
                total, n = self.usage[k]
                return total / n
        return None


async def read_answered(
    settings: Settings,
    pipeline: str | None = None,
    version: str | None = None,
    made_otherwise: Callable[[str, str, str], bool] | None = None,
) -> Answered:
    """What the results topic holds now (read to its end): the keys of `pipeline`'s
    results under `version`, when given (the keys of a topic's every result were held
    for a replay of one pipeline under a new version, which has none yet). A result
    tombstoned since (past the store's retention, or erased) is not held: until the
    topic's compaction dropped both, its task was skipped as answered, never again.
    `made_otherwise(pipeline, version, prompt_digest)`: was a result made under another
    definition of its version than the pipeline files' now (`Answered.stale`)?"""
    keys: set[bytes] = set()
    stale: set[bytes] = set()
    usage: dict[tuple[str, str | None], tuple[int, int]] = {}
    async for records in scan(settings, settings.topics.results):
        for r in records:
            if r.key is None:
                continue
            if r.value is None:
                keys.discard(r.key)
                stale.discard(r.key)
                continue
            result = json_object(r.value) or {}
            of, under = result.get("pipeline"), result.get("prompt_version")
            if (pipeline is None or of == pipeline) and (version is None or under == version):
                keys.add(r.key)
                made = result.get("prompt_digest")
                if (made_otherwise is not None and isinstance(of, str) and isinstance(under, str)
                        and isinstance(made, str) and made_otherwise(of, under, made)):  # fmt: skip
                    stale.add(r.key)
                else:  # the latest answer of the key counts
                    stale.discard(r.key)
            spent = result.get("usage")
            if result.get("cached") or not isinstance(spent, dict) or not isinstance(of, str):
                continue
            try:
                tokens = int(spent["completion_tokens"])
            except (KeyError, TypeError, ValueError):
                continue
            for k in ((of, under if isinstance(under, str) else None), (of, None)):
                total, n = usage.get(k, (0, 0))
                usage[k] = (total + tokens, n + 1)
    return Answered(keys, usage, stale)


async def read_erased(settings: Settings, start: dict[int, int] | None) -> dict[str, int]:
    """The tasks the erase requests on the tasks topic name (from `start`, per partition,
    to its end), each with the time of its latest request: a replay sends no record of a
    task older than its erasure — it answered it again, writing the answer the erasure
    had taken away (the task records stay on the tasks topic until its retention, and so
    do the requests that come after them)."""
    erased: dict[str, int] = {}
    async for records in scan(settings, settings.topics.tasks, start):
        for r in records:
            if not any(name == ERASE_HEADER for name, _ in r.headers or ()):
                continue
            try:
                task_id = EraseRequest.model_validate_json(r.value or b"").task_id
            except ValueError:
                continue  # the worker dead-letters it
            erased[task_id] = max(erased.get(task_id, r.timestamp), r.timestamp)
    return erased


async def load_checkpoint(settings: Settings, replay_id: str) -> Checkpoint | None:
    """The replay's latest readable checkpoint. One that cannot be read (cut short, or
    written by a version whose fields this one does not know) gives way to the one before
    it: resuming from earlier sends again only what the worker then skips as answered. When
    the topic (compacted) holds none readable, a ConfigError says so instead of a run that
    would start over with its spend counted from zero."""
    latest: Checkpoint | None = None
    unreadable: str | None = None
    async for records in scan(settings, replays_topic(settings)):
        for r in records:
            if r.key != replay_id.encode():
                continue
            if r.value is None:  # deleted: the next run starts over
                latest, unreadable = None, None
                continue
            try:
                latest, unreadable = Checkpoint.loads(r.value), None
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                log.warning("replay %s: checkpoint at offset %d unreadable (%r); the one "
                            "before it is used", replay_id, r.offset, exc)  # fmt: skip
                unreadable = f"offset {r.offset}: {exc!r}"
    if latest is None and unreadable is not None:
        raise ConfigError(
            f"replay {replay_id}: its only checkpoint in {replays_topic(settings)} cannot be "
            f"read ({unreadable}). Resume it with the version that wrote it, or delete it "
            f"(a null value under key {replay_id}) to start over"
        )
    return latest


Progress = Callable[[Checkpoint], None]


class AtBudget(Exception):  # a state, not an error
    """The next task would take the replay's estimated cost past its budget."""


class Replayer:
    """Plans, filters, estimates and (unless dry) publishes one replay."""

    def __init__(
        self,
        settings: Settings,
        request: ReplayRequest,
        registry: PipelineRegistry,
        *,
        chunk: int = CHUNK,
    ) -> None:
        self.settings = settings
        self.chunk = chunk
        self.request = request
        self.registry = registry
        self.finished_before = False  # the checkpoint said done: nothing sent
        self.resumed_at: str | None = None  # time of the checkpoint resumed from
        self.answered = Answered()  # read again by each `run`
        self._versions: dict[tuple[str, str], PipelineVersion | None] = {}  # in the files
        self.erased: dict[str, int] = {}  # task id -> its latest erase request's time, ms
        self.prices = Prices.from_settings(settings)
        if request.pipeline is not None:
            pipeline = registry.get(request.pipeline)  # unknown: InvalidInput, said at once
            if request.prompt_version is not None:
                pipeline.version(request.prompt_version)

    def _made_otherwise(self, pipeline: str, version: str, digest: str) -> bool:
        """Was a result of `digest` made under another definition of its version than the
        pipeline files' now? (A version not in them: not said.)"""
        key = (pipeline, version)
        if key not in self._versions:
            try:
                self._versions[key] = self.registry.get(pipeline).version(version)
            except TaskError:
                self._versions[key] = None
        now = self._versions[key]
        return now is not None and now.made_otherwise(digest)

    async def run(self, *, dry_run: bool, on_progress: Progress | None = None) -> Checkpoint:
        settings, request = self.settings, self.request
        replay_id = request.replay_id()
        checkpoint = None if dry_run else await load_checkpoint(settings, replay_id)
        if checkpoint is None:
            start, end = await resolve_range(settings, request)
            checkpoint = Checkpoint(replay_id=replay_id, source=request.source, start=start,
                                    end=end, next=dict(start), counts=Counts())  # fmt: skip
        elif checkpoint.done:
            self.finished_before = True
            return checkpoint
        else:
            self.resumed_at = checkpoint.updated_at
        self.answered = await read_answered(settings, request.pipeline, request.prompt_version,
                                            self._made_otherwise)  # fmt: skip
        from_start = checkpoint.start if request.source == settings.topics.tasks else None
        self.erased = await read_erased(settings, from_start)
        producer: AIOKafkaProducer | None = None
        sends: Sends | None = None
        if not dry_run:
            await ensure_topics(settings, [settings.topics.replay, replays_topic(settings)])
            producer = clients.producer(
                settings, acks="all", enable_idempotence=settings.kafka.idempotent_producer,
                linger_ms=5,
            )  # fmt: skip
            await producer.start()
            sends = Sends(producer)
        progress = on_progress or (lambda _cp: None)
        try:
            progress(checkpoint)
            checkpoint.at_budget = False
            await self._publish(sends, checkpoint, progress)
            if not checkpoint.at_budget:
                checkpoint.next = dict(checkpoint.end)  # gaps (compaction) at the tail
                checkpoint.done = True
            await self._checkpoint(sends, checkpoint)
            progress(checkpoint)
            return checkpoint
        finally:
            if producer is not None:
                await producer.stop()

    async def _publish(
        self, sends: Sends | None, checkpoint: Checkpoint, progress: Progress
    ) -> None:
        """Read the rest of the range, send what is to be answered again (unless dry),
        checkpointing after each chunk of records."""
        since_checkpoint = 0
        chunks = scan(self.settings, self.request.source, checkpoint.next, checkpoint.end,
                      self.chunk)  # fmt: skip
        async for records in chunks:
            for record in records:
                try:
                    send = self.publication(record, checkpoint)
                except AtBudget:  # this record and the rest wait for a higher budget
                    checkpoint.at_budget = True
                    progress(checkpoint)
                    return
                if send is not None and sends is not None:
                    key, value, headers = send
                    where = f"{record.topic}/{record.partition}/{record.offset}"
                    if not await sends.send(where, self.settings.topics.replay, key=key,
                                            value=value, headers=headers):  # fmt: skip
                        checkpoint.counts.unsent(1)
                checkpoint.next[record.partition] = record.offset + 1
            since_checkpoint += len(records)
            if since_checkpoint >= self.chunk:
                await self._checkpoint(sends, checkpoint)
                since_checkpoint = 0
            progress(checkpoint)

    def publication(
        self, record: ConsumerRecord[bytes, bytes], cp: Checkpoint
    ) -> tuple[bytes, bytes, list[tuple[str, bytes]]] | None:
        """What one record of the range becomes, against `answered`: counted in `cp`; the
        (key, value, headers) to publish, or None to skip it."""
        counts, request = cp.counts, self.request
        counts.read += 1
        try:
            task = decode_task(record.value, max_bytes=self.settings.batch.max_task_bytes)
            if request.pipeline is not None and task.pipeline != request.pipeline:
                counts.filtered += 1
                return None
            if record.timestamp <= self.erased.get(task.task_id, -1):
                counts.erased += 1
                return None
            pipeline = self.registry.get(task.pipeline)
            session = pipeline.session_of(task)  # its turns stay in order, on its partition
            version = pipeline.version(request.prompt_version or task.prompt_version,
                                       session or task.task_id)  # fmt: skip
            # A turn with earlier turns has a key with their digest, which only the worker
            # knows: such a task is sent, and the worker finds its answer if it has one.
            key = result_key(pipeline.name, version.version, task.task_id, task.input)
            if key.encode() in self.answered.keys and not request.force:
                counts.answered += 1
                counts.stale += key.encode() in self.answered.stale
                return None
            prompt = version.render(task.input, self.settings.llm.model)
        except TaskError:
            counts.invalid += 1
            return None
        prompt_tokens = count_messages(prompt.messages)
        earlier = self.answered.completion_estimate(pipeline.name, version.version)
        budgeted = float(completion_budget(prompt.params, DEFAULT_COMPLETION_TOKENS))
        completion = earlier if earlier is not None else budgeted
        tier = Tier(request.tier or pipeline.spec.lanes.of("replay"))
        cost = self.prices.estimate(prompt_tokens, completion, tier)
        budget = request.budget_usd
        if budget is not None and counts.estimated_usd + cost > budget + 1e-12:
            counts.read -= 1  # not taken: read again when the replay goes on
            raise AtBudget
        counts.published += 1
        counts.prompt_tokens += prompt_tokens
        counts.completion_tokens += completion
        counts.estimated_usd = round(counts.estimated_usd + cost, 8)
        # Pin the version resolved here, so the worker's result key is the one checked.
        value = task.model_dump(mode="json", exclude_none=True)
        value["prompt_version"] = version.version
        headers = [
            (REPLAY_ID_HEADER, cp.replay_id.encode()),
            (REPLAY_OF_HEADER, f"{record.topic}/{record.partition}/{record.offset}".encode()),
        ]
        if request.force:
            headers.append((FORCE_HEADER, b"1"))
        if request.tier is not None:
            headers.append((TIER_HEADER, request.tier.encode()))
        return (session or task.task_id).encode(), orjson.dumps(value), headers

    async def _checkpoint(self, sends: Sends | None, cp: Checkpoint) -> None:
        """Once the chunk's records are acked (or refused for good), record how far the
        replay got."""
        if sends is None:
            return
        cp.counts.unsent(len(await sends.wait()))
        await (await sends.producer.send(replays_topic(self.settings),
                                         key=cp.replay_id.encode(), value=cp.dumps()))  # fmt: skip


__all__ = [
    "Answered",
    "AtBudget",
    "Checkpoint",
    "Counts",
    "ReplayRequest",
    "Replayer",
    "load_checkpoint",
    "read_answered",
    "read_erased",
    "replays_topic",
    "resolve_range",
]
