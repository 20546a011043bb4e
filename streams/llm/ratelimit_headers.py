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
    - Mistral: the same `-minute` suffix, its requests as `req`
      (`x-ratelimit-limit-req-minute`); its monthly quotas left out;
    - Anthropic (its Messages API and its OpenAI SDK compatibility):
      `anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}`, the reset the
      time (RFC 3339) the bucket is full again — read as the seconds from `now` (the
      wall clock's) until then;
    - an API gateway in front of a server that says none (Envoy, Kong, others: request
      limits, `_gateway`).

    A header in OpenAI's own name wins over another's of the same meaning; one that is no
    per-minute limit, what is left of it or its reset (a day's, a month's quota, a call's
    cost, `x-ratelimit-limit-tokens_usage_based`) is left out: the limiter would take the
    provider for one that says its limits, and read none."""
    found: dict[str, str] = {}
    other: dict[str, str] = {}
    gateway: dict[str, str] = {}
    for name, value in headers.items():
        key = name.lower()
        if key in _OPENAI_NAMES:  # most answers' every rate-limit header
            found[key] = value
        elif key.startswith(_OPENAI) and key not in _GATEWAY_NAMES:
            named = _per_minute(key)
            if named == key:
                found[key] = value
            elif named is not None:
                other.setdefault(named, value)
        elif key.startswith((_IETF, _OPENAI)):
            gateway[key] = value
        elif key.startswith(_ANTHROPIC):
            _anthropic(key, value, now, other)
    if gateway and not any(key.endswith("-requests") for key in found):
        other = {**_gateway(gateway, now), **other}
    return {**other, **found}


_FIELDS = frozenset({"limit", "remaining", "reset"})
_KINDS = {"requests": "requests", "req": "requests", "tokens": "tokens"}
_OPENAI_NAMES = frozenset(f"{_OPENAI}{f}-{k}" for f in _FIELDS for k in ("requests", "tokens"))


def _per_minute(key: str) -> str | None:
    """An `x-ratelimit-*` header's OpenAI name when it is a per-minute limit, what is left
    of it or its reset (`-minute` and Mistral's `req` said otherwise), else None."""
    field, _, kind = key.removeprefix(_OPENAI).removesuffix("-minute").partition("-")
    named = _KINDS.get(kind)
    return f"{_OPENAI}{field}-{named}" if named is not None and field in _FIELDS else None


def _anthropic(key: str, value: str, now: float | None, into: dict[str, str]) -> None:
    """One of Anthropic's headers into `into` in OpenAI's name (another is left out)."""
    kind, _, field = key.removeprefix(_ANTHROPIC).rpartition("-")
    if kind not in ("requests", "tokens") or field not in ("limit", "remaining", "reset"):
        return  # input-tokens, output-tokens: within `tokens`, the one that binds
    said = _until(value, now) if field == "reset" else value
    if said is not None:
        into.setdefault(f"{_OPENAI}{field}-{kind}", said)


# An API gateway's request limits (no token counts: those are the LLM's), in the forms
# gateways send them: the IETF draft's (`RateLimit-Policy: 100;w=60` or `"p";q=100;w=60`,
# `RateLimit-Limit`, `RateLimit-Remaining`, `RateLimit-Reset` in seconds, or the later
# `RateLimit: "p";r=42;t=17`; some with an `X-` before each), Envoy's (draft 3:
# `X-RateLimit-Limit: 100, 100;w=60`, `X-RateLimit-Remaining`, `X-RateLimit-Reset`) and
# Kong's (`X-RateLimit-Limit-Second`, `-Minute`, with their `X-RateLimit-Remaining-*`).
_IETF = "ratelimit"
_KONG = {"second": 1.0, "minute": 60.0}
_GATEWAY_NAMES = frozenset(
    {"x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset", "x-ratelimit-policy"}
    | {f"x-ratelimit-{field}-{per}" for field in ("limit", "remaining") for per in _KONG}
)
_QUOTA = re.compile(r"(?:^|;)\s*q=(\d+(?:\.\d+)?)|^\s*(\d+(?:\.\d+)?)\s*(?:;|$)")
_PARAM = re.compile(r";\s*([a-z]+)=([0-9.]+)")


def _gateway(said: dict[str, str], now: float | None) -> dict[str, str]:
    """A gateway's request limit in OpenAI's names (its own or the upstream's request
    headers in those names win) — the limit per minute only where its window is said (a
    bare `RateLimit-Limit: 100` may be a second's or an hour's: left out, and its
    `remaining` with it). Of several limits, the one with the least per minute among
    those of a minute or less (an hour's or a day's quota is no rate)."""
    left = said.get("ratelimit-remaining") or said.get("x-ratelimit-remaining")
    reset = said.get("ratelimit-reset") or said.get("x-ratelimit-reset")
    current = said.get("ratelimit")
    if current is not None:  # the later draft: `"policy";r=<remaining>;t=<reset>`
        params = dict(_PARAM.findall(current.split(",")[0]))
        left, reset = params.get("r", left), params.get("t", reset)
    rates = [(rate, left) for rate in _said_rates(said)]
    for per, window_s in _KONG.items():
        limit = number(said.get(f"x-ratelimit-limit-{per}"))
        if limit is not None:
            rates.append((limit * 60.0 / window_s, said.get(f"x-ratelimit-remaining-{per}")))
    if not rates:
        return {}
    per_minute, remaining = min(rates, key=lambda rate: rate[0])
    out = {f"{_OPENAI}limit-requests": f"{per_minute:g}"}
    if remaining is not None and number(remaining) is not None:
        out[f"{_OPENAI}remaining-requests"] = remaining.strip()
    wait = reset_seconds(reset, now)
    if wait is not None:
        out[f"{_OPENAI}reset-requests"] = f"{wait:.3f}"
    return out


def _said_rates(said: dict[str, str]) -> list[float]:
    """The per-minute rates of the quotas said with their windows (`q;w=` items) of a
    minute or less."""
    rates = []
    for header in ("ratelimit-policy", "x-ratelimit-policy", "ratelimit-limit",
                   "x-ratelimit-limit"):  # fmt: skip
        for item in (said.get(header) or "").split(","):
            quota, window = _QUOTA.search(item), dict(_PARAM.findall(item)).get("w")
            if quota is None or window is None:
                continue
            limit, per = number(quota.group(1) or quota.group(2)), number(window)
            if limit is not None and per is not None and 0 < per <= 60:
                rates.append(limit * 60.0 / per)
    return rates


def reset_seconds(value: str | None, now: float | None = None) -> float | None:
    """A gateway's reset in seconds from now: seconds, or (some send the time itself) a
    Unix time in seconds or milliseconds."""
    found = number(value)
    if found is None:
        return None
    if found >= 1e12:
        found /= 1000.0
    if found >= 1e9:
        return max(0.0, found - (time.time() if now is None else now))
    return found


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


__all__ = ["delay", "number", "openai_names", "reset_seconds", "seconds"]
