"""The numbers of a provider's headers (`x-ratelimit-*`, `retry-after`): plain numbers,
and resets in OpenAI's duration form (`6m0s`, `1.5s`, `20ms`) or in seconds."""

from __future__ import annotations

import math
import re

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


__all__ = ["number", "seconds"]
