"""`llm-streams drift`: a pipeline's output drift per version, from the results topic, in
the terms the workers export (`core.drift`): the latest `window` answers of a version
against a baseline, either the stored one, another version's latest answers, or the
same version's answers between two times. `--save-baseline` stores the baseline chosen
(by default the current window) for every worker to hold its versions to.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from streams.contract.records import json_object
from streams.core.drift import FieldDrift, Profile, compare, features, field_kinds
from streams.kafka.scan import scan
from streams.settings import Settings
from streams.store.baselines import load_baselines, save_baseline

Answers = dict[str, list[tuple[str, dict[str, Any]]]]  # version -> (processed_at, output)


@dataclass(frozen=True)
class Baseline:
    """What to compare with: `stored`, `version:V`, or `window:FROM..TO` (ISO times)."""

    kind: str
    version: str | None = None
    since: str | None = None
    until: str | None = None

    @classmethod
    def parse(cls, text: str) -> Baseline:
        if text == "stored":
            return cls("stored")
        kind, _, rest = text.partition(":")
        if kind == "version" and rest:
            return cls("version", version=rest)
        if kind == "window" and ".." in rest:
            since, until = rest.split("..", 1)  # _utc: ValueError when not a time
            return cls("window", since=_utc(since), until=_utc(until))
        raise ValueError(f"{text!r}: give stored, version:V or window:FROM..TO (ISO times)")

    def describe(self) -> str:
        if self.kind == "version":
            return f"version {self.version}'s latest answers"
        if self.kind == "window":
            return f"answers from {self.since} to {self.until}"
        return "the stored baseline"


def _utc(t: str) -> str:
    """An ISO time as the records write theirs (UTC, milliseconds, `Z`), to compare as
    text; a time without a zone is UTC."""
    parsed = datetime.fromisoformat(t.replace("Z", "+00:00"))
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


async def answers(settings: Settings, pipeline: str) -> Answers:
    """Fresh answers (not cached) of `pipeline` per version, oldest first."""
    found: Answers = {}
    async for records in scan(settings, settings.topics.results):
        for rec in records:
            r = json_object(rec.value) if rec.value is not None else None
            if r is None or r.get("pipeline") != pipeline or r.get("cached"):
                continue
            if isinstance(r.get("output"), dict) and isinstance(r.get("prompt_version"), str):
                found.setdefault(r["prompt_version"], []).append(
                    (str(r.get("processed_at", "")), r["output"])
                )
    for rows in found.values():
        rows.sort(key=lambda row: row[0])
    return found


def profile(rows: list[tuple[str, dict[str, Any]]], schema: dict[str, Any]) -> Profile:
    kinds = field_kinds(schema)
    p = Profile()
    for _, output in rows:
        p.add(features(output, kinds))
    return p


@dataclass(frozen=True)
class VersionDrift:
    version: str
    answers: int
    baseline_answers: int
    fields: list[FieldDrift]


async def drift(
    settings: Settings,
    pipeline: str,
    schema: dict[str, Any],
    *,
    version: str | None = None,
    baseline: Baseline = Baseline("stored"),
    window: int = 1000,
    save: bool = False,
) -> tuple[list[VersionDrift], list[str]]:
    """Each version's (or `version`'s) drift, and the baselines saved (with `save`)."""
    found = await answers(settings, pipeline)
    stored = await load_baselines(settings) if baseline.kind == "stored" else {}
    kinds = field_kinds(schema)
    out, saved = [], []
    for name in sorted(found if version is None else [version]):
        rows = found.get(name, [])
        now = profile(rows[-window:], schema)
        if baseline.kind == "version":
            base: Profile | None = profile(found.get(str(baseline.version), [])[-window:], schema)
        elif baseline.kind == "window":
            since, until = str(baseline.since), str(baseline.until)
            base = profile([r for r in rows if since <= r[0] < until], schema)
        else:
            base = stored.get((pipeline, name))
        if save:
            kept = now if baseline.kind == "stored" else base
            if kept is not None and kept.answers:
                chosen = ("its latest answers" if baseline.kind == "stored"
                          else baseline.describe())  # fmt: skip
                await save_baseline(settings, pipeline, name, kept, chosen)
                saved.append(name)
        out.append(VersionDrift(name, now.answers, base.answers if base else 0,
                                compare(now, base, kinds)))  # fmt: skip
    return out, saved


__all__ = ["Baseline", "VersionDrift", "answers", "drift", "profile"]
