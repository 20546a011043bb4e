"""What an error answer's JSON body says, in the shapes servers send it: its error object
(`{"error": {...}}` as OpenAI and most others; the object itself; Gemini's OpenAI
endpoint: a list of them, `[{"error": {...}}]`), how long it asks to wait when it says
so in the body rather than a header (Google's `google.rpc.RetryInfo` detail), and which
of its limits a 429 says was hit (`limit_hit`).

A 429's headers say how much is left, not what ran out; its body does, in each
provider's words, and no library reads them (the SDKs keep the text), so they are read
here:

- OpenAI, Groq: "... on requests per min (RPM): Limit 30, Used 30, Requested 1." (tokens:
  "on tokens per minute (TPM)", a day's quota: "on requests per day (RPD)"); its `type`
  is "requests" or "tokens". A request larger than the limit itself: "Request too large
  ... on tokens per min (TPM): Limit 30000, Requested 30601."
- Azure OpenAI: "... have exceeded call rate limit ..." / "... token rate limit ..." (no
  figure).
- Cerebras: code `request_quota_exceeded` / `token_quota_exceeded`, "Requests per minute
  limit exceeded" (or per hour, per day).
- Anthropic: "... would exceed the rate limit for your organization ... of 50 requests per
  minute" ("input tokens", "output tokens").
- Gemini: a `google.rpc.QuotaFailure` detail naming the quota (`...RequestsPerMinute...`,
  `...InputTokensPerModelPerDay...`) and its `quotaValue`.
- OpenRouter's free models: "Rate limit exceeded: free-models-per-min" (or `-per-day`),
  the limit's own headers in the body (`metadata.headers`: `X-RateLimit-Limit`,
  `X-RateLimit-Reset` as a Unix time in milliseconds).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from streams.errors import MINUTE_S, LimitHit
from streams.llm.ratelimit_headers import number, reset_seconds, seconds

_RETRY_INFO = "type.googleapis.com/google.rpc.RetryInfo"
_QUOTA_FAILURE = "type.googleapis.com/google.rpc.QuotaFailure"

_PERIODS = {"second": 1.0, "sec": 1.0, "min": MINUTE_S, "minute": MINUTE_S,
            "hour": 3600.0, "day": 86400.0}  # fmt: skip
_UNIT = r"(requests|(?:input |output )?tokens)"
_FIGURE = r"(\d+(?:,\d{3})*)"  # 30000, 40,000
_PERIOD = r"(second|sec|minute|min|hour|day)"
# OpenAI and Groq: "on tokens per min (TPM): Limit 30000, Used 29000, Requested 2000".
_ON = re.compile(
    rf"\bon {_UNIT} per {_PERIOD}\b[^:]*:\s*Limit {_FIGURE}(?:, Used {_FIGURE})?"
    rf"(?:, Requested ~?{_FIGURE})?",
    re.IGNORECASE,
)
# Anthropic: "of 50 requests per minute", "of 40,000 input tokens per minute".
_OF = re.compile(rf"\bof {_FIGURE} {_UNIT} per {_PERIOD}\b", re.IGNORECASE)
# Cerebras: "Requests per minute limit exceeded".
_EXCEEDED = re.compile(rf"\b{_UNIT} per {_PERIOD} limit exceeded", re.IGNORECASE)
# Azure OpenAI: "exceeded call rate limit", "exceeded the token rate limit".
_AZURE = re.compile(r"exceeded (?:the )?(call|token) rate limit", re.IGNORECASE)
_CODES = {"request_quota_exceeded": "requests", "token_quota_exceeded": "tokens"}
# OpenRouter: "Rate limit exceeded: free-models-per-min", "...: free-models-per-day".
_FREE_MODELS = re.compile(r"\bfree-models-per-(min|day)\b", re.IGNORECASE)


def error_object(body: Any) -> Mapping[str, Any]:
    """The body's error object; empty when it has none."""
    if isinstance(body, list) and body:
        body = body[0]
    if isinstance(body, Mapping):
        inner = body.get("error", body)
        if isinstance(inner, Mapping):
            return inner
    return {}


def _details(body: Any, kind: str) -> list[Mapping[str, Any]]:
    details = error_object(body).get("details")
    if not isinstance(details, list):
        return []
    return [d for d in details if isinstance(d, Mapping) and d.get("@type") == kind]


def retry_delay(body: Any, now: float | None = None) -> float | None:
    """Seconds the body asks to wait: a RetryInfo detail's `retryDelay` (`"37s"`,
    `"0.5s"`), as Gemini's 429s say it, or the reset of the limit whose headers it
    carries (OpenRouter's); None when it says none. `now`: the wall clock's."""
    for detail in _details(body, _RETRY_INFO):
        said = detail.get("retryDelay")
        return seconds(said) if isinstance(said, str) else None
    reset = _carried(body).get("x-ratelimit-reset")
    return reset_seconds(reset, now) if isinstance(reset, str) else None


def _carried(body: Any) -> dict[str, Any]:
    """The headers an error object carries in its `metadata` (OpenRouter's), lower case."""
    metadata = error_object(body).get("metadata")
    headers = metadata.get("headers") if isinstance(metadata, Mapping) else None
    if not isinstance(headers, Mapping):
        return {}
    return {str(k).lower(): v for k, v in headers.items()}


def _figure(text: str | None) -> float | None:
    return number(text.replace(",", "")) if text else None


def _unit(text: str) -> tuple[str, bool]:
    """("requests" or "tokens", whether it is input or output tokens alone)."""
    text = text.lower()
    return ("requests", False) if text == "requests" else ("tokens", text != "tokens")


def _gemini(body: Any) -> LimitHit | None:
    """A QuotaFailure violation: its quota's id names the unit and the period."""
    for detail in _details(body, _QUOTA_FAILURE):
        for violation in detail.get("violations") or ():
            if not isinstance(violation, Mapping):
                continue
            quota = f"{violation.get('quotaId', '')} {violation.get('quotaMetric', '')}".lower()
            kind = "tokens" if "token" in quota else "requests" if "request" in quota else None
            period = next((s for p, s in _PERIODS.items() if f"per{p}" in quota), None)
            value = violation.get("quotaValue")
            limit = _figure(str(value)) if value is not None else None
            partial = kind == "tokens" and ("input" in quota or "output" in quota)
            return LimitHit(kind, period, None if partial else limit, partial=partial)
    return None


def limit_hit(body: Any, message: str = "") -> LimitHit | None:
    """Which limit a 429's body (or, without one, its message) says was hit; None when
    it names none."""
    error = error_object(body)
    said = error.get("message")
    text = said if isinstance(said, str) and said else message
    if (found := _ON.search(text)) is not None:
        kind, partial = _unit(found[1])
        limit = None if partial else _figure(found[3])
        return LimitHit(kind, _PERIODS[found[2].lower()], limit, _figure(found[5]), partial)
    if (found := _OF.search(text)) is not None:
        kind, partial = _unit(found[2])
        return LimitHit(kind, _PERIODS[found[3].lower()], None if partial else _figure(found[1]),
                        partial=partial)  # fmt: skip
    if (found := _EXCEEDED.search(text)) is not None:
        kind, partial = _unit(found[1])
        return LimitHit(kind, _PERIODS[found[2].lower()], partial=partial)
    if (found := _AZURE.search(text)) is not None:
        return LimitHit("requests" if found[1].lower() == "call" else "tokens", MINUTE_S)
    if (gemini := _gemini(body)) is not None:
        return gemini
    if (found := _FREE_MODELS.search(text)) is not None:
        limit = _carried(body).get("x-ratelimit-limit")
        return LimitHit("requests", _PERIODS[found[1].lower()],
                        _figure(limit) if isinstance(limit, str) else None)  # fmt: skip
    # Nothing in the words: the code (Cerebras') or the type (OpenAI's) may still say.
    named = _CODES.get(str(error.get("code"))) or error.get("type")
    return LimitHit(named) if named in ("requests", "tokens") else None


__all__ = ["error_object", "limit_hit", "retry_delay"]
