"""Spend caps set while workers run: `<app_id>-budgets`, compacted, one record per
pipeline holding the caps (`pipelines.specs.BudgetSpec`) that replace its pipeline
file's `budget:` — `{}` for none —, a tombstone to go back to the file's.
`llm-streams budget` writes them; every worker reads them at start and every
`budget.refresh_s`, and its tasks waiting at a cap raised go on at once."""

from __future__ import annotations

import logging
from typing import Any

import orjson
from pydantic import ValidationError

from streams.contract.records import now_iso
from streams.core.budget import Budgets
from streams.kafka import clients
from streams.kafka.scan import latest_objects, scan
from streams.kafka.topics import budgets_topic, ensure_topics
from streams.pipelines.specs import BudgetSpec
from streams.settings import Settings

log = logging.getLogger(__name__)


async def load_budgets(settings: Settings) -> dict[str, tuple[BudgetSpec, dict[str, Any]]]:
    """The caps set per pipeline, with the record that set them (none when the topic does
    not exist yet). A record this version cannot read is skipped, said once per read."""
    records = []
    async for batch in scan(settings, budgets_topic(settings)):
        records.extend(batch)
    out: dict[str, tuple[BudgetSpec, dict[str, Any]]] = {}
    for key, value in latest_objects(records).items():
        try:
            out[key.decode()] = (BudgetSpec.model_validate(value["budget"]), value)
        except (KeyError, TypeError, ValueError, ValidationError) as exc:
            log.warning("skipping the unreadable spend caps of %r: %s", key, exc)
    return out


async def refresh_budgets(settings: Settings, budgets: Budgets) -> None:
    """The caps set read again into `budgets`. While the topic cannot be read (the broker
    away), the worker keeps the caps it holds and the next refresh tries again."""
    try:
        stored = await load_budgets(settings)
    except Exception as exc:
        log.warning("could not read the spend caps set (keeping the %d held): %r",
                    len(budgets.overrides), exc)  # fmt: skip
        return
    budgets.override({name: spec for name, (spec, _) in stored.items()})


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


__all__ = ["load_budgets", "refresh_budgets", "save_budget"]
