"""The numbers of a provider's headers (`x-ratelimit-*`, `retry-after`): plain numbers,
and resets in OpenAI's duration form (`6m0s`, `1.5s`, `20ms`) or in seconds."""

from __future__ import annotations

import math
import re
import time
from email.utils import parsedate_to_datetime

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


__all__ = ["delay", "number", "seconds"]
