"""RPM + TPM limits of one endpoint/model, with priority lanes, that learn the real limit.

Both limits are token buckets (`resilience.bucket`) refilling continuously at limit/60
per second and holding `burst_s` seconds of it, the way providers enforce them (60 RPM
admits about one request per second, not 60 at once). Calls wait for capacity; they
never fail for it. Waiters are served by lane (live before replay), then in
arrival order, so a live call waits for about one slot however long the
replay queue is.

Learning: `x-ratelimit-limit-*` headers set the ceiling; `x-ratelimit-remaining-*`
lower our bucket when the provider (shared by other workers on the same key)
has less left than we think. Providers count `remaining` against different
windows — the minute (OpenAI), or the window that enforces (a second, for some
gateways) — so the window is learned, not assumed: a full provider bucket holds
`window * limit / 60`, and what is left plus what refills before the reset
(`x-ratelimit-reset-*`) is a full bucket, as is the most ever reported left.
A 429 cuts the rate multiplicatively and pauses everyone until its Retry-After;
the rate then recovers additively. Workers sharing a key converge to their
shares with no shared store (AIMD).

A provider that enforces a limit but says nothing of it (no `x-ratelimit-*` headers,
only 429s) leaves no ceiling to cut from: a cut from "unlimited" is still unlimited.
Its limit is then what it let through: at each 429, the ceiling becomes the rate the
provider answered over the last few seconds, and the rate is cut from there. While calls
wait at it and no 429 comes, the ceiling creeps up (never above "unlimited"), so a limit
measured low, or one that grew, is found.

A 429's body may say which limit it hit (`llm.error_body.limit_hit`): then only that
limit is cut; a figure it says is the limit's ceiling (Groq says its per-minute request
limit there alone: its headers' is per day, and is not steered by after); a limit it names
without a figure (Azure's token rate, Cerebras' requests) is measured at the pace the
provider let through, whatever other limit the headers say; a quota over more than a
minute (a day's) pauses, and teaches no pace.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from streams.contract.lanes import Lane
from streams.errors import LimitHit
from streams.llm.ratelimit_headers import number, seconds
from streams.resilience.bucket import EPSILON, Bucket, Granted
from streams.resilience.clock import Clock, MonotonicClock

log = logging.getLogger(__name__)

UNKNOWN_RPM = 1_000_000.0  # no limit known and none learned: effectively unlimited
PROBE_POLL_S = 0.05
CALM_S = 5.0  # this long without a 429: a rate held below our share goes straight to it
PACE_S = 10.0  # a header-less limit is what the provider answered over this long
# The longest a 429's wait pauses every call: a daily quota's "come back in 9 hours" (or
# a gateway's `retry-after: 1e9`) would otherwise hold the endpoint unasked until then —
# or for ever —, whatever the provider does meanwhile. After it, one call asks again.
MAX_PAUSE_S = 600.0


@dataclass(order=True)
class _Waiter:
    lane: int
    seq: int
    tokens: int = field(compare=False)
    future: asyncio.Future[bool] = field(compare=False)  # result: granted as the probe


@dataclass
class Permit:
    """Capacity granted for one call. Settle it once: `reconcile` with the real usage
    when an answer came, `abandon` when the call was cancelled."""

    limiter: RateLimiter
    estimated_tokens: int
    waited_s: float
    probe: bool = False  # the first call of a limiter that is learning the limit
    settled: bool = False
    # When it was granted, and the units granted by then (requests, tokens): what the
    # provider's report about this call is older than.
    granted_at: float = 0.0
    taken: tuple[float, float] = (0.0, 0.0)

    def reconcile(self, actual_tokens: int) -> None:
        if not self.settled:
            self.settled = True
            self.limiter.reconcile_tokens(self.estimated_tokens, actual_tokens)

    def abandon(self) -> None:
        """No answer (cancelled): the estimate stays spent; a probe's turn passes on."""
        if not self.settled:
            self.settled = True
            if self.probe:
                self.limiter.probe_abandoned()


class GroupShare:
    """This worker's part of its consumer group's work: the fraction of the group's input
    partitions assigned to it (None: not in a group, or alone in it). Set at every
    rebalance, read by the limiters of every model.

    The trend of `remaining` tells how much the key's other clients take, not how
    the key should be split: every split that sums to the limit fits it, and noise
    walks the split about, so one worker could crawl at a tenth while the others,
    done, leave the key idle. Members of one group are due what their partitions
    bring, so each claims at least that fraction of the limit; beyond it, what the
    others leave."""

    def __init__(self, fraction: float | None = None) -> None:
        self.fraction = fraction
        self.epoch = 0  # counts rebalances: who the others are may have changed

    def assigned(self, mine: int, total: int) -> None:
        self.fraction = mine / total if total > 0 and mine < total else None
        self.epoch += 1


@dataclass(frozen=True)
class LimiterSnapshot:
    rpm: float
    tpm: float | None
    rpm_ceiling: float
    tpm_ceiling: float | None
    paused_for_s: float
    waiting: int


class RateLimiter:
    def __init__(
        self,
        *,
        rpm: float | None,
        tpm: float | None = None,
        burst_s: float = 1.0,
        decrease: float = 0.7,
        decrease_informed: float = 0.9,
        recover_per_s: float = 0.05,
        floor: float = 0.05,
        headroom: float = 1.0,
        safety: float = 0.995,
        clock: Clock | None = None,
        group: GroupShare | None = None,
    ) -> None:
        if (rpm is not None and rpm <= 0) or (tpm is not None and tpm <= 0):
            raise ValueError("limits must be positive")
        self.clock = clock or MonotonicClock()
        now = self.clock.now()
        # Unknown limit: one call goes first (slow start) and its answer's headers set
        # the ceiling, so a cold worker does not fire a whole batch into a 429 wall.
        self.probing = rpm is None
        self.told = rpm is not None  # a limit we were given is not measured over
        self._probe_out = False
        rpm = rpm or UNKNOWN_RPM
        self.rpm_ceiling = float(rpm)
        self.tpm_ceiling = float(tpm) if tpm else None
        self._margins = {"headroom": headroom, "safety": safety}
        self.requests = Bucket(rpm, burst_s, now, **self._margins)
        self.tokens = Bucket(tpm, burst_s, now, **self._margins) if tpm else None
        self.decrease = decrease
        self.decrease_informed = decrease_informed
        # The provider says its limit (`x-ratelimit-limit-*`). One that says what is left
        # and not of what (Azure OpenAI: `remaining` alone) is not: its limit is measured
        # at its 429s, as a silent provider's is.
        self.informed = False
        self._said_rpm = False  # a request limit was said: `remaining` steers it (a told one too)
        self._said_tpm = tpm is not None  # ... a token limit (told, or said in headers)
        # The request limit the headers last said; and one a 429's body contradicted with a
        # per-minute figure of its own: while the headers say it, theirs is a limit over
        # another period (Groq's `x-ratelimit-limit-requests` is per day), not steered by.
        self._header_rpm: float | None = None
        self._other_period_rpm: float | None = None
        self._granted_tokens = 0.0  # tokens let go, with or without a token bucket
        self.tokens_reported = False  # ... and x-ratelimit-remaining-tokens among them
        self.recover_per_s = recover_per_s
        self.floor = floor
        self.group = group or GroupShare()
        self._epoch = self.group.epoch
        self._group_since = float("-inf")  # when this limiter last saw the group change
        self.paused_until = now
        self._last_recover = now
        self._queue: list[_Waiter] = []
        self._seq = itertools.count()
        self._pump: asyncio.Task[None] | None = None
        self._woken: asyncio.Future[None] | None = None  # the sleeping pump's wake-up
        self._mean_tokens = 0.0
        self._last_cut = float("-inf")  # when a 429 last cut the rate
        # (time, requests, tokens let go) about once a second over the last PACE_S: the
        # pace a provider that says no limit let through, read at its 429s.
        self._paces: deque[tuple[float, float, float]] = deque(
            [(now, 0.0, 0.0)], maxlen=int(PACE_S) + 1
        )
        self.measured = False  # the request ceiling is a limit measured at 429s
        self.tokens_measured = False  # ... the token ceiling

    # -- granting ------------------------------------------------------------
    async def acquire(self, tokens: int = 0, lane: Lane = Lane.LIVE) -> Permit:
        started = self.clock.now()
        if not self._queue and self._wait_time(tokens, started) <= EPSILON:
            # Nobody waiting and capacity free: no queue round trip.
            return self._permit(tokens, 0.0, self._grant(tokens))
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(int(lane), next(self._seq), tokens, future)
        heapq.heappush(self._queue, waiter)
        if self._pump is None or self._pump.done():
            self._pump = asyncio.create_task(self._run())
        elif self._queue[0] is waiter:
            # It goes first now (a live call before replay ones, or a smaller one): the
            # pump's sleep was for another. Behind the head it changes nothing, and a
            # backlog's every new waiter would wake the pump once more per grant.
            self._wake()
        try:
            probe = await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.result():
                self.probe_abandoned()  # granted as the probe, then cancelled: pass it on
            raise
        return self._permit(tokens, self.clock.now() - started, probe)

    def _permit(self, tokens: int, waited_s: float, probe: bool) -> Permit:
        taken = (self.requests.taken, self.tokens.taken if self.tokens is not None else 0.0)
        return Permit(self, tokens, waited_s, probe=probe, granted_at=self.clock.now(),
                      taken=taken)  # fmt: skip

    def _grant(self, tokens: int) -> bool:
        """Take capacity for one call; True when it is the probe of a learning limiter."""
        self._probe_out = self.probing
        self.requests.level -= 1
        self.requests.taken += 1
        self._granted_tokens += tokens
        if self.tokens is not None:
            self.tokens.level -= tokens
            self.tokens.taken += tokens
            # A call's worth of margin: calls reach the provider a little apart from when
            # they are let go, and one of average size must still find room there.
            self._mean_tokens += (tokens - self._mean_tokens) * 0.1
            if self._margins["headroom"]:
                self.tokens.headroom = max(self._margins["headroom"], self._mean_tokens)
        return self.probing

    def probe_abandoned(self) -> None:
        """The probe got no answer: the next call probes instead."""
        if self.probing and self._probe_out:
            self._probe_out = False
            self._wake()

    def _wait_time(self, tokens: int, now: float) -> float:
        if self.probing and self._probe_out:
            return PROBE_POLL_S  # until the first answer (or its 429) teaches us the limit
        if now - self._paces[-1][0] >= 1.0:
            self._paces.append((now, self.requests.taken, self._granted_tokens))
        self._recover(now)
        self.requests.refill(now)
        wait = max(self.paused_until - now, self.requests.wait_for(1))
        if self.tokens is not None and tokens:
            self.tokens.refill(now)
            wait = max(wait, self.tokens.wait_for(tokens))
        return wait

    async def _run(self) -> None:
        while self._queue:
            head = self._queue[0]
            if head.future.done():  # cancelled while waiting
                heapq.heappop(self._queue)
                continue
            now = self.clock.now()
            wait = self._wait_time(head.tokens, now)
            if wait <= EPSILON:
                heapq.heappop(self._queue)
                head.future.set_result(self._grant(head.tokens))
                continue
            # Sleep until the head can go, or until a waiter that goes first (or news
            # from the provider) wakes it: one future and one timer per sleep, not a
            # task for each way to wake and an asyncio.wait over them.
            self._woken = asyncio.get_running_loop().create_future()
            timer = self.clock.call_later(wait, self._wake)
            try:
                await self._woken
            finally:
                timer.cancel()
                self._woken = None

    def _wake(self) -> None:
        """The sleeping pump looks at the queue again (nothing if it is not asleep: it
        looks before it sleeps)."""
        if self._woken is not None and not self._woken.done():
            self._woken.set_result(None)

    def reconcile_tokens(self, estimated: int, actual: int) -> None:
        """The call's estimate settled against what it used: unused tokens go back —
        unless the provider reports what it has left, which then already counts the
        call as the provider charged it (OpenAI charges the prompt and the whole
        completion budget at admission, whatever the answer used)."""
        if self.tokens is not None and not self.tokens_reported:
            self.tokens.level += estimated - actual
        self._learned()

    def _learned(self) -> None:
        """The first answer is in: stop probing (with or without headers)."""
        if self.probing:
            self.probing = False
            self._wake()

    # -- learning ------------------------------------------------------------
    def _follow_group(self, now: float) -> None:
        """After a rebalance (a member joined or left), what the others took says nothing
        of what they will take: measure again from `now` — reports of calls granted
        before it are no samples of the new group —, claiming our part meanwhile."""
        if self.group.epoch == self._epoch:
            return
        self._epoch = self.group.epoch
        self._group_since = now
        others = 1.0 - self.group.fraction if self.group.fraction is not None else 0.0
        for b in (self.requests, self.tokens):
            if b is not None:
                b.others_mean, b.others_var, b.sampled, b.last_report = 0.0, 0.0, False, None
                b.others_due = others

    def _recover(self, now: float) -> None:
        self._follow_group(now)
        elapsed = now - self._last_recover
        self._last_recover = now
        if elapsed <= 0 or now < self.paused_until:
            return
        # Long after the last 429, a rate below our share was held there by the share
        # itself (a neighbour seen, a smaller part of the group): it follows the share
        # at once, the provider's `remaining` guarding the step. After a 429 it climbs.
        # Above our share (a rebalance just made it smaller: a member joined), the rate
        # comes down to it before the next grant, not at the next report: a worker that
        # had the key to itself would else spend a whole bucket beside the newcomer's.
        calm = self.informed and now - self._last_cut >= CALM_S
        step = float("inf") if calm else self.recover_per_s * elapsed
        if self._queue and now - self._last_cut >= CALM_S:
            # A measured limit may be low (measured while the rate climbed) or may have
            # grown: while calls wait at it and no 429 comes, it creeps up, until the next
            # 429 measures it again (no higher than "unlimited", however long the calm).
            grow = 1 + self.recover_per_s * elapsed
            if self.measured and not self._said_rpm:
                self.rpm_ceiling = min(UNKNOWN_RPM, self.rpm_ceiling * grow)
            if self.tokens_measured and not self._said_tpm and self.tpm_ceiling:
                self.tpm_ceiling *= grow
        buckets = [(self.requests, self.rpm_ceiling)]
        if self.tokens is not None and self.tpm_ceiling:
            buckets.append((self.tokens, self.tpm_ceiling))
        for bucket, ceiling in buckets:
            top = self.share(bucket, ceiling)
            if bucket.per_minute > top:
                bucket.set_rate(top, now)
            elif bucket.per_minute < top:
                bucket.set_rate(min(top, bucket.per_minute + step * ceiling), now)

    def share(self, bucket: Bucket, ceiling: float) -> float:
        """Our share of a limit, per minute: what other clients of the key leave, and at
        least our part of the group's work (see `GroupShare`).

        In a group, every member reads the others from noisy samples, and each one
        claiming beyond its part on a high draw made the group claim more than the key:
        beyond its part, a member claims what the others leave beyond their estimate's
        noise. The claims on high draws add up over the members, so the margin grows
        with the group: none for two (the key's bucket catches one member's high draw;
        a margin there cost two real workers 0.6-0.9% of the key), half the samples'
        spread for many (32 simulated members refused 1.4% of calls, 3.9% without).
        Its part is the group's fraction, not the floor: 32 members at a floor of 5%
        claimed 160% of the key."""
        fraction = self.group.fraction
        if fraction is None:
            return max(ceiling * self.floor, ceiling - bucket.others_per_s * 60.0)
        due = ceiling * fraction
        if not bucket.sampled:
            return due  # the other members are about to take theirs: no more until seen
        others = bucket.others_per_s + bucket.others_margin * max(0.0, 1.0 - 2.0 * fraction)
        return max(due, ceiling - others * 60.0)

    def throttled(
        self, retry_after_s: float | None, permit: Permit | None = None, hit: LimitHit | None = None
    ) -> None:
        """The provider answered 429: cut the rate, and pause everyone until Retry-After.
        `permit`: the refused call. One burst is one event: a call let go before the
        last cut was sent at the old rate, so its 429 pauses but does not cut again
        (a burst of 24 refusals would otherwise cut the rate to 0.9**24 of itself).
        `hit`: which limit the 429's body says ran out, when it says (only that one is
        cut; a quota over more than a minute only pauses)."""
        now = self.clock.now()
        if permit is not None:
            # Not charged by the provider: were it counted among our grants, the trend of
            # `remaining` would read the others as taking that much less.
            self.requests.taken -= 1
            self._granted_tokens -= permit.estimated_tokens
            if self.tokens is not None:
                self.tokens.taken -= permit.estimated_tokens
        kind = hit.kind if hit is not None and not hit.partial else None
        learns = hit is None or not hit.quota  # a day's quota spent: its wait is the news
        if learns and (permit is None or permit.granted_at > self._last_cut):
            self._last_cut = now
            if kind != "tokens":
                self._cut_requests(now, hit if kind == "requests" else None)
            if kind != "requests":
                self._cut_tokens(now, hit if kind == "tokens" else None)
        if kind == "tokens" and self.tokens is not None:
            self.tokens.level = min(self.tokens.level, 0.0)
        else:
            self.requests.level = min(self.requests.level, 0.0)
        if retry_after_s:
            self.paused_until = max(self.paused_until, now + min(retry_after_s, MAX_PAUSE_S))
        self._last_recover = max(now, self.paused_until)
        log.info(
            "throttled: rpm now %.0f, paused %.2fs", self.requests.per_minute, retry_after_s or 0
        )
        self._wake()

    def _cut_requests(self, now: float, hit: LimitHit | None) -> None:
        """A 429 of the request limit (`hit`: the body said so), or of a limit unnamed."""
        if hit is not None and hit.limit is not None and hit.per_s is not None:
            limit = hit.limit * 60.0 / hit.per_s
            if limit != self.rpm_ceiling:
                log.info("the provider says its request limit is %g/min (was %g)",
                         limit, self.rpm_ceiling)  # fmt: skip
                self.rpm_ceiling = limit
                self.requests.peak_remaining = 0.0
            if self._header_rpm is not None and self._header_rpm != limit:
                self._other_period_rpm = self._header_rpm
            self._said_rpm = self.informed = True
        elif not self._said_rpm and not self.told and (hit is not None or not self.informed):
            # No request limit said (nor told): it is measured. One that says its token
            # limit alone (Cerebras) is not, unless its body names the requests': its
            # unnamed 429s are most likely the tokens'.
            self._measure_ceiling(now)
        # A provider that reports its limit and remaining capacity already steers the
        # buckets; a 429 then means jitter or a neighbour's burst: cut gently.
        factor = self.decrease_informed if self.informed else self.decrease
        self.requests.set_rate(
            max(self.rpm_ceiling * self.floor,
                min(self.requests.per_minute, self.rpm_ceiling) * factor), now
        )  # fmt: skip

    def _cut_tokens(self, now: float, hit: LimitHit | None) -> None:
        """A 429 of the token limit (`hit`: the body said so), or of a limit unnamed. A
        token limit named and not said anywhere (Azure's) is measured, its bucket made."""
        if hit is not None and hit.limit is not None and hit.per_s is not None:
            limit = hit.limit * 60.0 / hit.per_s
            if self.tokens is None:
                self.tokens = Bucket(limit, self.requests.burst_s, now, **self._margins)
            elif limit != self.tpm_ceiling:
                self.tokens.peak_remaining = 0.0
            self.tpm_ceiling = limit
            self._said_tpm = self.informed = True
        elif hit is not None and not self._said_tpm:
            self._measure_tokens(now)
        if self.tokens is not None and self.tpm_ceiling:
            factor = self.decrease_informed if self.informed else self.decrease
            self.tokens.set_rate(
                max(self.tpm_ceiling * self.floor,
                    min(self.tokens.per_minute, self.tpm_ceiling) * factor), now
            )  # fmt: skip

    def _pace(self, now: float, column: int, current: float) -> float:
        """Per minute, what was let go over the last PACE_S (at least over one second):
        requests (column 1) or tokens (2)."""
        since, then = self._paces[0][0], self._paces[0][column]
        return (current - then) / max(now - since, 1.0) * 60.0

    def _measure_ceiling(self, now: float) -> None:
        """A 429 from a provider that says nothing of its limit: the limit is the pace it
        answered at over the last PACE_S (at least over one second), and our rate, if
        above, comes down to it before the cut. In a group, our pace is our part of the
        key's: the key's limit is taken as that pace over our share of the group."""
        pace = self._pace(now, 1, self.requests.taken)
        if pace <= 0:
            return
        self.rpm_ceiling = pace / max(self.floor, self.group.fraction or 1.0)
        self.measured = True
        if self.requests.per_minute > pace:
            self.requests.set_rate(pace, now)
        log.info("the provider refused a call and says no limit: measured %.0f RPM", pace)

    def _measure_tokens(self, now: float) -> None:
        """The same for a token limit the provider names at its 429s and says nowhere."""
        pace = self._pace(now, 2, self._granted_tokens)
        if pace <= 0:
            return
        self.tpm_ceiling = pace / max(self.floor, self.group.fraction or 1.0)
        self.tokens_measured = True
        if self.tokens is None:
            self.tokens = Bucket(pace, self.requests.burst_s, now, **self._margins)
        elif self.tokens.per_minute > pace:
            self.tokens.set_rate(pace, now)
        log.info("the provider refused a call for tokens and says no limit: measured %.0f TPM",
                 pace)  # fmt: skip

    def observe(
        self, headers: Mapping[str, str], permit: Permit | None = None, *, refused: bool = False
    ) -> None:
        """Steer the buckets by the provider's `x-ratelimit-*` headers, when it sends them.
        `permit`: the call they answer (its report is as old as the call); `refused`: a
        429's headers (what is left then says nothing of the limit)."""
        now = self.clock.now()
        self._follow_group(now)
        # What we had granted of each bucket when the call the report answers was let go.
        requests = tokens = None
        if permit is not None:
            requests = Granted(permit.granted_at, permit.taken[0])
            tokens = Granted(permit.granted_at, permit.taken[1])
        said = number(headers.get("x-ratelimit-limit-requests"))
        # The figure a 429's body contradicted: a limit over another period, and so is its
        # `remaining`. Another figure (the limits changed) is read again.
        per_minute = said is None or said != self._other_period_rpm
        if said is not None:
            self._header_rpm = said
            self._said_rpm = self._said_rpm or per_minute
        # `remaining` of a limit not known says too little.
        if (self.told or self._said_rpm) and per_minute:
            self._steer(self.requests, headers, "requests", now, ceiling_attr="rpm_ceiling",
                        since=requests)  # fmt: skip
        if any(k.startswith("x-ratelimit-limit-") for k in headers):
            self.informed = True
        if any(k.startswith("x-ratelimit-") for k in headers):
            self._learned()
        self._observe_tokens(headers, now, tokens, None if refused else permit)

    def _observe_tokens(
        self,
        headers: Mapping[str, str],
        now: float,
        since: Granted | None,
        answered: Permit | None,
    ) -> None:
        """`answered`: the call the headers answer, when it was answered (not refused)."""
        if self.tokens is None:
            # A token limit we were not told about: start a bucket at the provider's figure.
            tpm = number(headers.get("x-ratelimit-limit-tokens"))
            left = number(headers.get("x-ratelimit-remaining-tokens"))
            if tpm is None and left is not None and answered is not None:
                # What is left and not of what (Azure OpenAI, counted against the minute):
                # at the first report, what is left plus what the call took is about the
                # limit. A start, measured again at its 429s (else its first burst of
                # calls, at "unlimited", met a wall of them).
                tpm = left + answered.estimated_tokens
                self.tokens_measured = True
            if tpm is not None and tpm >= 1:
                self.tokens = Bucket(tpm, self.requests.burst_s, now, **self._margins)
                self.tpm_ceiling = tpm
        if "x-ratelimit-limit-tokens" in headers:
            self._said_tpm = True
        if self.tokens is not None and self._said_tpm:
            self._steer(self.tokens, headers, "tokens", now, ceiling_attr="tpm_ceiling",
                        since=since)  # fmt: skip
        if "x-ratelimit-remaining-tokens" in headers:
            self.tokens_reported = True  # it charges at admission: nothing unused comes back

    def _steer(
        self,
        bucket: Bucket,
        headers: Mapping[str, str],
        kind: str,
        now: float,
        *,
        ceiling_attr: str,
        since: Granted | None = None,
    ) -> None:
        limit = number(headers.get(f"x-ratelimit-limit-{kind}"))
        remaining = number(headers.get(f"x-ratelimit-remaining-{kind}"))
        if limit is not None and limit >= 1 and limit != getattr(self, ceiling_attr):
            log.info(
                "provider %s limit is %g/min (was %g)", kind, limit, getattr(self, ceiling_attr)
            )
            setattr(self, ceiling_attr, limit)
            bucket.peak_remaining = 0.0  # a new limit: learn its window again
            if bucket.per_minute > limit:
                bucket.set_rate(limit, now)
        if remaining is not None:
            bucket.refill(now)
            bucket.peak_remaining = max(bucket.peak_remaining, remaining + 1)
            # The window `remaining` is counted against. A full provider bucket holds
            # window * limit / 60: the most ever reported left (+1: the call answered),
            # or what is left now plus what refills until the reset.
            ceiling = getattr(self, ceiling_attr) or bucket.per_minute
            reset = seconds(headers.get(f"x-ratelimit-reset-{kind}"))
            window = 60.0 * bucket.peak_remaining / ceiling
            if reset is not None:
                window = max(window, 60.0 * remaining / ceiling + reset)
            window = min(60.0, window)
            # The provider's bucket (shared with other clients of the key) has less left:
            # in our bucket's units, remaining * burst / window (no more than remaining).
            scale = min(bucket.burst_s, window) / window if window > 0 else 1.0
            left = remaining * scale
            if since is not None:
                if since.at >= self._group_since:  # else granted before the group changed
                    bucket.sample_others(ceiling, since, left, reset)
                # The report is as old as the call it answers: since then the provider's
                # bucket (no fuller than full) refilled, and took what we and (at their
                # pace) others let go since. What it has left is every client's: ours is
                # our part of it, as our pace is of all (each client waiting out all of a
                # shortfall waits it once per client: 4 workers took 0.89 of the key).
                elapsed = max(0.0, now - since.at)
                pool = (min(bucket.provider_full(ceiling), left + elapsed * ceiling / 60.0)
                        - (bucket.taken - since.taken) - bucket.others_per_s * elapsed)  # fmt: skip
                ours = bucket.per_minute / 60.0
                left = pool * ours / (ours + bucket.others_per_s) if ours > 0 else pool
                share = self.share(bucket, ceiling)
                if bucket.per_minute > share:
                    bucket.set_rate(share, now)
            bucket.level = min(bucket.level, left)

    def ready_in(self) -> float:
        """Seconds until a call of average size would go, behind the calls waiting here:
        what the router compares deployments by (an estimate; it takes nothing)."""
        now = self.clock.now()
        ahead = len(self._queue)  # a cancelled waiter among them: a small overestimate
        tokens = int(self._mean_tokens)
        wait = self._wait_time(tokens, now)
        if ahead:
            wait += ahead * 60.0 / max(self.requests.per_minute, 1e-6)
            if self.tokens is not None and tokens:
                wait = max(wait, ahead * tokens * 60.0 / max(self.tokens.per_minute, 1e-6))
        return wait

    def rates(self) -> tuple[float, float | None]:
        """Current requests and tokens per minute (tokens None without a token limit)."""
        return self.requests.per_minute, self.tokens.per_minute if self.tokens else None

    def snapshot(self) -> LimiterSnapshot:
        return LimiterSnapshot(
            rpm=self.requests.per_minute,
            tpm=self.tokens.per_minute if self.tokens else None,
            rpm_ceiling=self.rpm_ceiling,
            tpm_ceiling=self.tpm_ceiling,
            paused_for_s=max(0.0, self.paused_until - self.clock.now()),
            waiting=sum(1 for w in self._queue if not w.future.done()),
        )
