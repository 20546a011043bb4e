"""`llm-streams drift`: a pipeline's output drift per version, from the results topic, in
the terms the workers export (`core.drift`): the latest `window` answers of a version
against a baseline, either the stored one, another version's latest answers, or the
same version's answers between two times. `--save-baseline` stores the baseline chosen
(by default the current window) for every worker to hold its versions to.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from datetime import UTC
from typing import Any

from streams.contract.records import json_object, stored_time
from streams.core.drift import FieldDrift, Profile, compare, features, field_kinds
from streams.kafka.scan import scan
from streams.settings import Settings
from streams.store.baselines import load_baselines, save_baseline


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
    parsed = stored_time(t)
    if parsed is None:
        raise ValueError(f"not an ISO time: {t!r}")
    return parsed.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass
class VersionAnswers:
    """What a drift needs of one version's fresh answers: the latest `window` of them (a
    heap by time, oldest first), and those between a baseline window's times summed up."""

    latest: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)
    between: Profile = field(default_factory=Profile)

    def rows(self) -> list[tuple[str, dict[str, Any]]]:
        return [(at, output) for at, _, output in sorted(self.latest)]


async def answers(
    settings: Settings,
    pipeline: str,
    schema: dict[str, Any],
    *,
    window: int,
    between: tuple[str, str] | None = None,
) -> dict[str, VersionAnswers]:
    """Fresh answers (not cached) of `pipeline` per version: the latest `window` and, when
    `between` is given, those in it summed up. Only those are held, not every answer the
    results topic keeps (a year of a pipeline's answers was held whole)."""
    kinds = field_kinds(schema)
    found: dict[str, VersionAnswers] = {}
    seen = 0
    async for records in scan(settings, settings.topics.results):
        for rec in records:
            r = json_object(rec.value) if rec.value is not None else None
            if r is None or r.get("pipeline") != pipeline or r.get("cached"):
                continue
            output, version = r.get("output"), r.get("prompt_version")
            if not isinstance(output, dict) or not isinstance(version, str):
                continue
            at, seen = str(r.get("processed_at", "")), seen + 1
            kept = found.setdefault(version, VersionAnswers())
            if len(kept.latest) < window:
                heapq.heappush(kept.latest, (at, seen, output))
            elif (at, seen) > kept.latest[0][:2]:
                heapq.heapreplace(kept.latest, (at, seen, output))
            if between is not None and between[0] <= at < between[1]:
                kept.between.add(features(output, kinds))
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
    between = (str(baseline.since), str(baseline.until)) if baseline.kind == "window" else None
    found = await answers(settings, pipeline, schema, window=window, between=between)
    stored = await load_baselines(settings) if baseline.kind == "stored" else {}
    kinds = field_kinds(schema)
    out, saved = [], []
    for name in sorted(found if version is None else [version]):
        kept = found.get(name, VersionAnswers())
        now = profile(kept.rows(), schema)
        if baseline.kind == "version":
            other = found.get(str(baseline.version), VersionAnswers())
            base: Profile | None = profile(other.rows(), schema)
        elif baseline.kind == "window":
            base = kept.between
        else:
            base = stored.get((pipeline, name))
        if save:
            chosen_profile = now if baseline.kind == "stored" else base
            if chosen_profile is not None and chosen_profile.answers:
                chosen = ("its latest answers" if baseline.kind == "stored"
                          else baseline.describe())  # fmt: skip
                await save_baseline(settings, pipeline, name, chosen_profile, chosen)
                saved.append(name)
        out.append(VersionDrift(name, now.answers, base.answers if base else 0,
                                compare(now, base, kinds)))  # fmt: skip
    return out, saved


__all__ = ["Baseline", "VersionAnswers", "VersionDrift", "answers", "drift", "profile"]
