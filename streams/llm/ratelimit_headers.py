"""The numbers of a provider's headers (`x-ratelimit-*`, `retry-after`): plain numbers,
and resets in OpenAI's duration form (`6m0s`, `1.5s`, `20ms`) or in seconds; and other
providers' rate-limit headers read in OpenAI's names, the ones the limiter learns from."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping
from datetime import datetime
from email.utils import parsedate_to_datetime

_OPENAI = "x-ratelimit-"
_ANTHROPIC = "anthropic-ratelimit-"

_DURATION = re.compile(
    r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m(?!s))?"
    r"(?:(\d+(?:\.\d+)?)s)?(?:(\d+(?:\.\d+)?)ms)?"
)


def seconds(value: str | None) -> float | None:
    """A reset header in seconds: OpenAI's `6m0s`, `1.5s`, `20ms`, or a plain number."""
    if not value:
        return None
    plain = number(value)
    if plain is not None:
        return plain
    found = _DURATION.fullmatch(value.strip())
    if found is None or not any(found.groups()):
        return None
    h, m, sec, ms = (float(g) if g else 0.0 for g in found.groups())
    return h * 3600 + m * 60 + sec + ms / 1000


def number(value: str | None) -> float | None:
    """A header's number: finite and at least 0 (a negative count, as a gateway past its
    limit may say, is 0); None for none, `nan` or `inf`."""
    if value is None:
        return None
    try:
        found = float(value)
    except ValueError:
        return None
    return max(0.0, found) if math.isfinite(found) else None


def delay(value: str | None, now: float | None = None) -> float | None:
    """A `retry-after` header in seconds: a number of them, or an HTTP date (RFC 9110)
    as the seconds from `now` (the wall clock's) until then, at least 0."""
    found = number(value)
    if found is not None or not value:
        return found
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:  # a date in no zone: no telling when
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def openai_names(headers: Mapping[str, str], now: float | None = None) -> dict[str, str]:
    """A response's rate-limit headers in OpenAI's names (`x-ratelimit-{limit,remaining,
    reset}-{requests,tokens}`, lower case), whichever provider's they are:

    - OpenAI, Azure OpenAI, Groq, OpenRouter: those names already;
    - Cerebras: per-minute limits named with a `-minute` suffix
      (`x-ratelimit-remaining-tokens-minute`); its per-day quotas are left out, a day's
      quota being no per-minute rate (the 429 that ends one says when to come back);
    - Anthropic (its Messages API and its OpenAI SDK compatibility):
      `anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}`, the reset the
      time (RFC 3339) the bucket is full again — read as the seconds from `now` (the
      wall clock's) until then.

    A header in OpenAI's own name wins over another's of the same meaning."""
    found: dict[str, str] = {}
    other: dict[str, str] = {}
    for name, value in headers.items():
        key = name.lower()
        if key.startswith(_OPENAI):
            if key.endswith(("-day", "-hour")):
                continue
            if key.endswith("-minute"):
                other.setdefault(key.removesuffix("-minute"), value)
            else:
                found[key] = value
        elif key.startswith(_ANTHROPIC):
            kind, _, field = key.removeprefix(_ANTHROPIC).rpartition("-")
            if kind not in ("requests", "tokens") or field not in ("limit", "remaining", "reset"):
                continue  # input-tokens, output-tokens: within `tokens`, the one that binds
            said = _until(value, now) if field == "reset" else value
            if said is not None:
                other.setdefault(f"{_OPENAI}{field}-{kind}", said)
    return {**other, **found}


def _until(stamp: str, now: float | None) -> str | None:
    """An RFC 3339 time as the seconds from `now` until then (at least 0), or None."""
    try:
        when = datetime.fromisoformat(stamp.strip())
    except ValueError:
        return None
    if when.tzinfo is None:
        return None
    left = when.timestamp() - (time.time() if now is None else now)
    return f"{max(0.0, left):.3f}"


__all__ = ["delay", "number", "openai_names", "seconds"]
