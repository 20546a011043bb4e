"""A token bucket in units per minute, as a provider's limit is enforced, the last
report of the provider's own bucket about one of our calls (`Report`), and what the
key's other clients take, from the trend of two reports (`Bucket.sample_others`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

EPSILON = 1e-9


class Granted(NamedTuple):
    """A call as a report about it is read: when it was let go, and the units we had
    granted by then."""

    at: float
    taken: float


@dataclass(frozen=True)
class Report:
    """What the provider said of its bucket after one of our calls."""

    granted_at: float  # when the call it answers was let go
    taken: float  # units we had granted by then
    left: float  # the provider's level, in our bucket's units
    reset: float | None  # the reset it reported (s), if it did


class Bucket:
    """A token bucket in units per minute; the level may go below zero (debt).

    It runs a hair inside the provider's own bucket: one unit less of burst
    (`headroom`) and `safety` of the rate, so calls that reach the provider a few
    milliseconds apart from when we let them go still find capacity there.
    """

    def __init__(
        self,
        per_minute: float,
        burst_s: float,
        now: float,
        *,
        headroom: float = 1.0,
        safety: float = 0.995,
    ) -> None:
        self.per_minute = per_minute
        self.burst_s = burst_s
        self.headroom = headroom
        self.safety = safety
        self.level = self.capacity
        self.stamp = now
        self.peak_remaining = 0.0  # the most the provider ever reported left (a full bucket)
        self.taken = 0.0  # every unit ever granted: what was granted since a report
        # Other clients of the key, seen in the trend of `remaining`: their units per
        # second (a moving average), and the report that trend is measured from.
        self.others_mean = 0.0  # moving average of the samples, noise both ways included
        self.others_var = 0.0  # ... and of their squared distance from it (their spread)
        self.sampled = False  # a first sample is in: until then the others are unknown
        # The part of the limit the other members of the group are due: where the moving
        # average starts, not from nothing (its first sample would else read them as
        # taking a fifth of what they take, and our share leap to most of the key just
        # as they start).
        self.others_due = 0.0
        # The last report about one of our calls (its trend against the next says what
        # the key's other clients took meanwhile).
        self.last_report: Report | None = None
        # A fixed window (its reset counts down with the clock): nothing refills until
        # it ends, so the trend of `remaining` says nothing about other clients.
        self.fixed_window = False

    @property
    def capacity(self) -> float:
        full = self.per_minute * self.burst_s / 60.0
        return max(1.0, full - self.headroom if full - self.headroom >= 1.0 else full)

    @property
    def others_per_s(self) -> float:
        return max(0.0, self.others_mean)

    def provider_full(self, ceiling: float) -> float:
        """The provider's bucket when full, at limit `ceiling`, in our bucket's units."""
        return ceiling * self.burst_s / 60.0

    @property
    def others_margin(self) -> float:
        """Half the samples' spread, units per second: about 1.5 standard errors of their
        moving average (gain 0.2), how far above it the others may really be."""
        return 0.5 * math.sqrt(self.others_var)

    @property
    def _per_second(self) -> float:
        return self.per_minute * self.safety / 60.0

    def refill(self, now: float) -> None:
        elapsed = max(0.0, now - self.stamp)
        self.level = min(self.capacity, self.level + elapsed * self._per_second)
        self.stamp = now

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` can be taken (a request larger than the bucket waits for
        a full bucket, then takes it into debt)."""
        need = min(amount, self.capacity)
        missing = need - self.level
        if missing <= EPSILON:  # float dust must not turn into an endless 1e-17 s sleep
            return 0.0
        return missing / self._per_second

    def set_rate(self, per_minute: float, now: float) -> None:
        self.refill(now)
        self.per_minute = per_minute
        self.level = min(self.level, self.capacity)

    def sample_others(
        self, ceiling: float, since: Granted, left: float, reset: float | None
    ) -> None:
        """What other clients of the key take, from two reports: the provider's level
        went from the last report's to `left` while it refilled and we took our grants;
        the rest is theirs. Skipped when the provider's bucket may have been full
        meanwhile (its refill then stops), and for good once its reset is seen counting
        down with the clock: a fixed window, which does not refill as time passes."""
        granted_at, taken = since.at, since.taken
        last = self.last_report
        if last is not None and granted_at - last.granted_at >= 0.05 and not self.fixed_window:
            dt = granted_at - last.granted_at
            # A bucket's reset moves with what is taken; a window's only with the clock
            # (with two or more calls between the reports, a bucket's would differ).
            if (
                reset is not None
                and last.reset is not None
                and reset > 0.05
                and taken - last.taken >= 2
                and abs(last.reset - dt - reset) < 0.01 + 0.02 * dt
            ):
                self.fixed_window = True
                self.others_mean = self.others_var = 0.0
                return
            refilled = dt * ceiling / 60.0
            full = self.provider_full(ceiling)
            if last.left + refilled < full:
                theirs = last.left + refilled - (taken - last.taken) - left
                sample = theirs / dt  # not clipped: noise both ways averages out
                if not self.sampled:
                    self.others_mean = self.others_due * ceiling / 60.0
                deviation = sample - self.others_mean
                self.others_mean += deviation * 0.2
                self.others_var += (deviation * deviation - self.others_var) * 0.2
                self.sampled = True
            elif left >= full / 2:
                # The provider's bucket stayed (nearly) full: the key has capacity nobody
                # uses, whatever the others take. Let the estimate fall, slowly (a pause
                # of everyone, such as a rebalance, looks the same), so our share grows
                # into it; were it kept, a worker held to a small share by a neighbour
                # that has since gone idle would stay there for good (its own pace never
                # drains the bucket enough to be measured again).
                self.others_mean *= 0.95
                self.others_var *= 0.95**2
        if last is None or granted_at > last.granted_at:
            self.last_report = Report(granted_at, taken, left, reset)


__all__ = ["EPSILON", "Bucket", "Granted", "Report"]
