"""The simulator's rate limits: requests and tokens per minute as a token bucket that
refills continuously (OpenAI's shape) or as a fixed budget per window that resets when
the window ends (providers that count per minute or per second), and the
`x-ratelimit-*` headers OpenAI sends with every answer."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

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
        return headers


__all__ = ["UNLIMITED_RPM", "Limits", "SimLimits", "duration"]
