"""The simulator's rate limits: requests and tokens per minute as a token bucket that
refills continuously (OpenAI's shape) or as a fixed budget per window that resets when
the window ends (providers that count per minute or per second), and the
`x-ratelimit-*` headers OpenAI sends with every answer — or the same news in another
provider's headers (`header_style`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Protocol

from streams.llm.ratelimit_headers import seconds

Now = Callable[[], float]  # the limits' clock: time.monotonic, or a simulation's

# The request limit said when none is configured (OpenAI always says one).
UNLIMITED_RPM = 1_000_000  # as many as the worker takes for a limit nobody said


class Limits(Protocol):
    """What the simulator's rpm and tpm are configured with."""

    rpm: int
    tpm: int
    burst_s: float
    limit_shape: str
    window_s: float
    remaining_window_s: float
    header_style: str


class _Bucket:
    """Token bucket refilling at limit/60 per second, holding `burst_s` seconds of it."""

    def __init__(self, now: Now = time.monotonic) -> None:
        self.now = now
        self.level = 0.0
        self.stamp = now()
        self.limit = 0

    def configure(self, limit: int, burst_s: float) -> None:
        if limit != self.limit:
            self.limit = limit
            self.level = self.capacity(burst_s)
            self.stamp = self.now()

    def capacity(self, burst_s: float) -> float:
        return max(1.0, self.limit * burst_s / 60.0)

    def refill(self, burst_s: float) -> None:
        now = self.now()
        self.level = min(self.capacity(burst_s), self.level + (now - self.stamp) * self.limit / 60)
        self.stamp = now

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` is available (0 when it is)."""
        missing = max(0.0, amount - self.level)
        return missing * 60 / self.limit if self.limit else 0.0

    def remaining(self, burst_s: float, window_s: float) -> int:
        """What is left, counted against `window_s` (60: as a share of the minute)."""
        return max(0, int(self.level * window_s / burst_s))

    def reset_s(self, burst_s: float) -> float:
        return max(0.0, (self.capacity(burst_s) - self.level) * 60 / self.limit)


class _Window:
    """A fixed budget of limit * window_s / 60 per window, reset when each window ends."""

    def __init__(self, window_s: float, now: Now = time.monotonic) -> None:
        self.now = now
        self.window_s = window_s
        self.limit = 0
        self.used = 0.0
        self.start = now()

    def configure(self, limit: int, burst_s: float) -> None:
        if limit != self.limit:
            self.limit = limit
            self.used = 0.0
            self.start = self.now()

    def capacity(self, burst_s: float) -> float:
        return max(1.0, self.limit * self.window_s / 60.0)

    def refill(self, burst_s: float) -> None:
        now = self.now()
        if now >= self.start + self.window_s:
            self.start += (now - self.start) // self.window_s * self.window_s
            self.used = 0.0

    @property
    def level(self) -> float:
        return self.capacity(0.0) - self.used

    @level.setter
    def level(self, value: float) -> None:
        self.used = self.capacity(0.0) - value

    def wait_for(self, amount: float) -> float:
        return 0.0 if self.level >= amount else self.start + self.window_s - self.now()

    def remaining(self, burst_s: float, window_s: float) -> int:
        return max(0, int(self.level * window_s / self.window_s))

    def reset_s(self, burst_s: float) -> float:
        return max(0.0, self.start + self.window_s - self.now())


def duration(seconds: float) -> str:
    """OpenAI's reset format: `20ms`, `1.5s`, `6m0s`."""
    if seconds < 1:
        return f"{int(seconds * 1000)}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    return f"{int(seconds // 60)}m{int(seconds % 60)}s"


class SimLimits:
    """The configured rpm and tpm, in the configured shape; fresh when the shape changes
    or after `reset` (full buckets, a new window)."""

    def __init__(self, window_s: float, now: Now = time.monotonic) -> None:
        self.now = now
        self.requests: _Bucket | _Window = _Bucket(now)
        self.tokens: _Bucket | _Window = _Bucket(now)
        self._shape_now: tuple[str, float] | None = ("bucket", window_s)

    def reset(self) -> None:
        self._shape_now = None  # the next request makes them (`_shape`), full

    def _shape(self, cfg: Limits) -> None:
        """The limits' shape follows the config (changed while running: fresh limits)."""
        shape = (cfg.limit_shape, cfg.window_s)
        if shape != self._shape_now:
            if cfg.limit_shape not in ("bucket", "window"):
                raise ValueError(f"limit_shape {cfg.limit_shape!r}: bucket or window")
            self._shape_now = shape
            now = self.now
            make = ((lambda: _Window(cfg.window_s, now)) if cfg.limit_shape == "window"
                    else (lambda: _Bucket(now)))  # fmt: skip
            self.requests, self.tokens = make(), make()

    def admit(self, cfg: Limits, tokens: int) -> tuple[float, str] | None:
        """Take capacity for one request, or say how long to wait and which limit hit."""
        self._shape(cfg)
        self.requests.configure(cfg.rpm, cfg.burst_s)
        self.tokens.configure(cfg.tpm, cfg.burst_s)
        if cfg.rpm:
            self.requests.refill(cfg.burst_s)
            if self.requests.level < 1:
                return self.requests.wait_for(1), "requests"
        if cfg.tpm:
            self.tokens.refill(cfg.burst_s)
            need = min(tokens, self.tokens.capacity(cfg.burst_s))
            if self.tokens.level < need:
                return self.tokens.wait_for(need), "tokens"
        if cfg.rpm:
            self.requests.level -= 1
        if cfg.tpm:
            self.tokens.level -= tokens
        return None

    def headers(self, cfg: Limits) -> dict[str, str]:
        """OpenAI's `x-ratelimit-*` headers for the limits as they stand."""
        headers: dict[str, str] = {}
        window = cfg.remaining_window_s
        if not cfg.rpm and not cfg.tpm:
            # OpenAI sends its limits on every answer; with none configured here, a limit
            # nobody reaches: an endpoint that has rate limits, not one to learn slots of.
            headers["x-ratelimit-limit-requests"] = str(UNLIMITED_RPM)
        if cfg.rpm:
            left = self.requests.remaining(cfg.burst_s, window)
            headers["x-ratelimit-limit-requests"] = str(cfg.rpm)
            headers["x-ratelimit-remaining-requests"] = str(left)
            headers["x-ratelimit-reset-requests"] = duration(self.requests.reset_s(cfg.burst_s))
        if cfg.tpm:
            left = self.tokens.remaining(cfg.burst_s, window)
            headers["x-ratelimit-limit-tokens"] = str(cfg.tpm)
            headers["x-ratelimit-remaining-tokens"] = str(left)
            headers["x-ratelimit-reset-tokens"] = duration(self.tokens.reset_s(cfg.burst_s))
        return styled(headers, cfg.header_style)


# How providers other than OpenAI say the same: `anthropic` (Anthropic's API and its
# OpenAI SDK compatibility: `anthropic-ratelimit-<kind>-<field>`, the reset an RFC 3339
# time to the second), `cerebras` (per-minute token headers named `...-tokens-minute`,
# its requests as a per-day quota: the per-minute request limit enforced, not said),
# `azure` (Azure OpenAI: `x-ratelimit-remaining-requests` and `-tokens` alone, no limit
# and no reset said), `groq` (OpenAI's names, the request ones a day's quota: the
# per-minute request limit said in its 429s' body alone); and an API gateway in front of
# a server that says nothing, its request limit alone (it counts no tokens): `envoy`
# (the IETF draft 3 as Envoy sends it: `x-ratelimit-limit: 3000, 3000;w=60`,
# `x-ratelimit-remaining`, `x-ratelimit-reset` in seconds), `kong` (per second:
# `X-RateLimit-Limit-Second`, `X-RateLimit-Remaining-Second`, `RateLimit-Reset`);
# `mistral` (per-minute `x-ratelimit-{limit,remaining}-{req,tokens}-minute`, no reset,
# monthly token quotas and a call's cost beside them).
HEADER_STYLES = ("openai", "anthropic", "cerebras", "azure", "groq", "envoy", "kong",
                 "mistral")  # fmt: skip


def styled(headers: dict[str, str], style: str, wall: float | None = None) -> dict[str, str]:
    """OpenAI's rate-limit headers as a provider of `style` sends the same news."""
    if style == "openai":
        return headers
    if style == "azure":
        return {k: v for k, v in headers.items() if k.startswith("x-ratelimit-remaining-")}
    if style == "groq":
        return _per_day(headers)
    if style in ("envoy", "kong"):
        return _gateway(headers, style)
    if style == "mistral":
        return _mistral(headers)
    if style not in HEADER_STYLES:
        raise ValueError(f"header_style {style!r}: one of {', '.join(HEADER_STYLES)}")
    return _renamed(headers, style, wall)


def _renamed(headers: dict[str, str], style: str, wall: float | None) -> dict[str, str]:
    """Anthropic's and Cerebras' names for the same figures."""
    now = datetime.fromtimestamp(time.time() if wall is None else wall, UTC)
    out: dict[str, str] = {}
    for kind in ("requests", "tokens"):
        limit = headers.get(f"x-ratelimit-limit-{kind}")
        if limit is None:
            continue
        left = headers.get(f"x-ratelimit-remaining-{kind}", limit)
        reset = seconds(headers.get(f"x-ratelimit-reset-{kind}")) or 0.0
        if style == "anthropic":
            at = (now + timedelta(seconds=reset)).replace(microsecond=0)
            if at < now + timedelta(seconds=reset):
                at += timedelta(seconds=1)  # to the second, never before the bucket is full
            out[f"anthropic-ratelimit-{kind}-limit"] = limit
            out[f"anthropic-ratelimit-{kind}-remaining"] = left
            out[f"anthropic-ratelimit-{kind}-reset"] = at.strftime("%Y-%m-%dT%H:%M:%SZ")
        elif kind == "tokens":
            out["x-ratelimit-limit-tokens-minute"] = limit
            out["x-ratelimit-remaining-tokens-minute"] = left
            out["x-ratelimit-reset-tokens-minute"] = f"{reset:.2f}"
        else:  # a day's quota: 1,440 minutes of the limit, the day's end its reset
            midnight = (now + timedelta(days=1)).replace(hour=0, minute=0, second=0,
                                                        microsecond=0)  # fmt: skip
            out["x-ratelimit-limit-requests-day"] = str(int(limit) * 1440)
            out["x-ratelimit-remaining-requests-day"] = str(int(limit) * 1440 // 2)
            out["x-ratelimit-reset-requests-day"] = str(math.ceil((midnight - now).total_seconds()))
    return out


def _gateway(headers: dict[str, str], style: str) -> dict[str, str]:
    """The request limit as a gateway says it (`envoy`: per minute; `kong`: per second,
    its `remaining` the second's), the reset to the whole second; no token headers."""
    limit = headers.get("x-ratelimit-limit-requests")
    if limit is None:
        return {}
    left = headers.get("x-ratelimit-remaining-requests", limit)
    reset = str(math.ceil(seconds(headers.get("x-ratelimit-reset-requests")) or 0.0))
    if style == "envoy":
        return {"x-ratelimit-limit": f"{limit}, {limit};w=60", "x-ratelimit-remaining": left,
                "x-ratelimit-reset": reset}  # fmt: skip
    per_second = f"{int(limit) / 60:g}"
    return {"X-RateLimit-Limit-Second": per_second, "X-RateLimit-Remaining-Second": left,
            "RateLimit-Limit": per_second, "RateLimit-Remaining": left,
            "RateLimit-Reset": reset}  # fmt: skip


def _mistral(headers: dict[str, str]) -> dict[str, str]:
    """Mistral's names: per minute, its requests `req`; no reset; a month's token quota
    (30 days of the minute's, most of it left) and the call's cost beside them."""
    out: dict[str, str] = {}
    for kind, name in (("requests", "req"), ("tokens", "tokens")):
        limit = headers.get(f"x-ratelimit-limit-{kind}")
        if limit is not None:
            out[f"x-ratelimit-limit-{name}-minute"] = limit
            out[f"x-ratelimit-remaining-{name}-minute"] = headers.get(
                f"x-ratelimit-remaining-{kind}", limit
            )
    tokens = headers.get("x-ratelimit-limit-tokens")
    if tokens is not None:
        out["x-ratelimit-limit-tokens-month"] = str(int(tokens) * 43_200)
        out["x-ratelimit-remaining-tokens-month"] = str(int(tokens) * 40_000)
        out["x-ratelimit-tokens-query-cost"] = "52"
    return out


def _per_day(headers: dict[str, str]) -> dict[str, str]:
    """Groq's: the request headers, in OpenAI's names, say a day's quota (1,440 minutes of
    the limit, half of it left, one request back every day / quota)."""
    limit = headers.get("x-ratelimit-limit-requests")
    if limit is None:
        return headers
    per_day = int(limit) * 1440
    return {**headers, "x-ratelimit-limit-requests": str(per_day),
            "x-ratelimit-remaining-requests": str(per_day // 2),
            "x-ratelimit-reset-requests": duration(86400 / per_day)}  # fmt: skip


def refusal(
    kind: str, limit: int, requested: int, wait_s: float, model: str, style: str, said: bool
) -> tuple[str, str | None, str | None]:
    """A 429's (message, type, code) as a provider of `style` words it, for the `kind` of
    limit hit ("requests" or "tokens"); `said`: the provider names its limits (a silent
    one's 429 says only that it refused)."""
    if not said:
        return "Too Many Requests", "rate_limit_error", None
    per = "RPM" if kind == "requests" else "TPM"
    if style == "azure":
        what = "call" if kind == "requests" else "token"
        return (f"Requests to the ChatCompletions_Create Operation under Azure OpenAI API "
                f"version 2024-10-21 have exceeded {what} rate limit of your current OpenAI "
                f"S0 pricing tier. Please retry after {max(1, math.ceil(wait_s))} seconds.",
                None, "429")  # fmt: skip
    if style == "cerebras":
        if kind == "requests":
            return ("Requests per minute limit exceeded - too many requests sent.",
                    "too_many_requests_error", "request_quota_exceeded")  # fmt: skip
        return ("Tokens per minute limit exceeded - too many tokens processed.",
                "too_many_requests_error", "token_quota_exceeded")  # fmt: skip
    if style in ("envoy", "kong"):  # the gateway's words: it knows no model
        return "API rate limit exceeded", None, None
    if style == "mistral":  # which limit, not said
        return "Rate limit exceeded", "rate_limited", "1300"
    if style == "anthropic":
        return (f"This request would exceed the rate limit for your organization of "
                f"{limit:,} {kind} per minute. For details, refer to the rate limits "
                f"documentation.", "rate_limit_error", None)  # fmt: skip
    minute = "minute" if style == "groq" else "min"
    return (f"Rate limit reached for {model} in organization org-sim on {kind} per {minute} "
            f"({per}): Limit {limit}, Requested {requested}. Please try again in "
            f"{duration(wait_s)}.", kind, "rate_limit_exceeded")  # fmt: skip


__all__ = ["HEADER_STYLES", "UNLIMITED_RPM", "Limits", "SimLimits", "duration", "refusal",
           "styled"]  # fmt: skip
