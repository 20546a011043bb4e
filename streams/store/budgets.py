"""Spend caps on Kafka, and the spend under them.

- `<app_id>-budgets`, compacted: one record per pipeline holding the caps
  (`pipelines.specs.BudgetSpec`) that replace its pipeline file's `budget:` — `{}` for
  none —, a tombstone to go back to the file's. `llm-streams budget` writes them.
- `<app_id>-budget-spend`, compacted: each task partition's spend in each cap's window
  (`core.budget.SpendMark`), written by the partition's owner. A restarted worker, or a
  partition's next owner, goes on counting from it: a crash forgets at most the spend of
  one `budget.refresh_s`.

Every worker saves what its partitions spent and reads both at start and every
`budget.refresh_s`; its tasks waiting at a cap raised go on at once."""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

import orjson
from aiokafka import AIOKafkaProducer
from pydantic import ValidationError

from streams.contract.records import now_iso
from streams.core.budget import Budgets, SpendMark
from streams.kafka import clients
from streams.kafka.scan import Follower, latest_of, latest_of_each
from streams.kafka.topics import budget_spend_topic, budgets_topic, ensure_topics
from streams.pipelines.specs import BudgetSpec, Caps
from streams.settings import Settings

log = logging.getLogger(__name__)


async def load_budgets(
    settings: Settings, follower: Follower | None = None
) -> dict[str, tuple[BudgetSpec, dict[str, Any]]]:
    """The caps set per pipeline, with the record that set them (none when the topic does
    not exist yet). A record this version cannot read is skipped, with a warning.
    `follower`: the worker's reader of the topic (else it is read whole)."""
    return _caps(await latest_of(settings, budgets_topic(settings), follower))


async def load_spend(settings: Settings, follower: Follower | None = None) -> list[SpendMark]:
    """The spends saved per partition and cap window (none before the first)."""
    return _spend(await latest_of(settings, budget_spend_topic(settings), follower))


def _caps(latest: dict[bytes, dict[str, Any]]) -> dict[str, tuple[BudgetSpec, dict[str, Any]]]:
    out: dict[str, tuple[BudgetSpec, dict[str, Any]]] = {}
    for key, value in latest.items():
        try:
            out[key.decode()] = (_stored_caps(value["budget"]), value)
        except (KeyError, TypeError, ValueError, ValidationError) as exc:
            log.warning("skipping the unreadable spend caps of %r: %s", key, exc)
    return out


def _stored_caps(value: Any) -> BudgetSpec:
    """Caps as `llm-streams budget` stored them, checked as a pipeline file's — but a
    field a newer version added is left out, not a reason to drop the caps this version
    knows (during a rolling upgrade the older workers would spend without them)."""
    if isinstance(value, dict):
        value = {name: _known(field, Caps) if name in ("live", "replay") else field
                 for name, field in value.items() if name in BudgetSpec.model_fields}  # fmt: skip
    return BudgetSpec.model_validate(value)


def _known(value: Any, model: type[Caps]) -> Any:
    return {k: v for k, v in value.items() if k in model.model_fields} if isinstance(
        value, dict) else value  # fmt: skip


def _spend(latest: dict[bytes, dict[str, Any]]) -> list[SpendMark]:
    marks = []
    for value in latest.values():
        try:
            marks.append(SpendMark.read(value))
        except ValueError as exc:
            log.warning("skipping an unreadable spend record: %s", exc)
    return marks


class BudgetSync:
    """A worker's budgets against Kafka: its partitions' spend saved, the caps set and the
    spend saved read back (`sync`, at start and every `budget.refresh_s`). While the
    broker is away, the worker keeps what it holds and the next sync tries again.

    Saves go through one producer kept from the first save to `stop()` (a producer made
    per save was a bootstrap, a metadata request and, on a secured cluster, a TLS and SASL
    handshake every refresh while a capped pipeline spends — and as many new connections
    for the brokers); a save that fails closes it, the next one makes it again."""

    def __init__(
        self, settings: Settings, budgets: Budgets, follower: Follower | None = None
    ) -> None:
        self.settings = settings
        self.budgets = budgets
        self.follower = follower  # the worker's reader of the caps and spend topics
        self._producer: AIOKafkaProducer | None = None
        self._stopped = False  # the worker stops: no producer made again

    async def sync(self) -> None:
        marks = self.budgets.unsaved()
        try:
            try:
                await self._save(marks)
            except BaseException:
                self.budgets.not_saved(marks)  # saved at the next sync
                raise
            caps, spend = budgets_topic(self.settings), budget_spend_topic(self.settings)
            each = await latest_of_each(self.settings, [caps, spend], self.follower)  # one read
            stored, saved = _caps(each[caps]), _spend(each[spend])
        except Exception as exc:
            log.warning("could not sync the spend caps with Kafka (keeping the %d held): %r",
                        len(self.budgets.overrides), exc)  # fmt: skip
            self.budgets.synced()  # tried: not held up longer by a broker away
            return
        self.budgets.override({name: spec for name, (spec, _) in stored.items()})
        self.budgets.seed(saved)
        self.budgets.synced()

    async def _save(self, marks: list[SpendMark]) -> None:
        """The marks, acked (saves come at most every refresh, and only while a capped
        pipeline spends)."""
        if not marks:
            return
        topic = budget_spend_topic(self.settings)
        try:
            producer = await self._started()
            sent = [await producer.send(topic, orjson.dumps(asdict(mark)), key=mark.key.encode())
                    for mark in marks]  # fmt: skip
            for future in sent:
                await future
        except BaseException:
            await self._close()  # whatever it holds, the next save starts afresh
            raise

    async def _started(self) -> AIOKafkaProducer:
        if self._producer is not None:
            return self._producer
        if self._stopped:
            raise RuntimeError("the spend sync is stopped")
        producer = clients.producer(self.settings, acks="all")
        try:
            await producer.start()
            if self._stopped:  # stopped while it started: never kept
                raise RuntimeError("the spend sync is stopped")
        except BaseException:
            await producer.stop()
            raise
        self._producer = producer
        return producer

    async def _close(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            try:
                await producer.stop()
            except Exception as exc:
                log.debug("closing the spend producer: %r", exc)

    async def stop(self) -> None:
        """Closed for good (the worker stops): a save under way fails, none starts again."""
        self._stopped = True
        await self._close()


async def save_budget(
    settings: Settings, pipeline: str, spec: BudgetSpec | None
) -> dict[str, Any] | None:
    """Set `pipeline`'s caps to `spec` over its file's (None: back to the file's), acks=all;
    the record written (None for the tombstone)."""
    topic = budgets_topic(settings)
    await ensure_topics(settings, [topic])
    record = None
    if spec is not None:
        record = {"pipeline": pipeline, "budget": spec.model_dump(exclude_none=True),
                  "at": now_iso()}  # fmt: skip
    producer = clients.producer(settings, acks="all")
    await producer.start()
    try:
        value = orjson.dumps(record) if record is not None else None
        await producer.send_and_wait(topic, value, key=pipeline.encode())
    finally:
        await producer.stop()
    return record


__all__ = ["BudgetSync", "load_budgets", "load_spend", "save_budget"]
