"""What an error answer's JSON body says, in the shapes servers send it: its error object
(`{"error": {...}}` as OpenAI and most others; the object itself; Gemini's OpenAI
endpoint: a list of them, `[{"error": {...}}]`) and how long it asks to wait when it says
so in the body rather than a header (Google's `google.rpc.RetryInfo` detail)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from streams.llm.ratelimit_headers import seconds

_RETRY_INFO = "type.googleapis.com/google.rpc.RetryInfo"


def error_object(body: Any) -> Mapping[str, Any]:
    """The body's error object; empty when it has none."""
    if isinstance(body, list) and body:
        body = body[0]
    if isinstance(body, Mapping):
        inner = body.get("error", body)
        if isinstance(inner, Mapping):
            return inner
    return {}


def retry_delay(body: Any) -> float | None:
    """Seconds the body asks to wait: a RetryInfo detail's `retryDelay` (`"37s"`,
    `"0.5s"`), as Gemini's 429s say it; None when it says none."""
    details = error_object(body).get("details")
    if not isinstance(details, list):
        return None
    for detail in details:
        if isinstance(detail, Mapping) and detail.get("@type") == _RETRY_INFO:
            said = detail.get("retryDelay")
            return seconds(said) if isinstance(said, str) else None
    return None


__all__ = ["error_object", "retry_delay"]
