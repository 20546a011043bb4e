from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streams.contract.lanes import Lane
from streams.errors import LimitHit
from streams.resilience.bucket import Granted
from streams.resilience.clock import FakeClock
from streams.resilience.limiter import GroupShare, RateLimiter


def exact(**kw: object) -> RateLimiter:
    """A limiter without the safety margins, for exact timing arithmetic."""
    return RateLimiter(headroom=0.0, safety=1.0, **kw)  # type: ignore[arg-type]


async def _grants(
    limiter: RateLimiter, clock: FakeClock, calls: list[tuple[int, Lane]]
) -> list[tuple[float, int, Lane]]:
    out: list[tuple[float, int, Lane]] = []

    async def one(i: int, tokens: int, lane: Lane) -> None:
        await limiter.acquire(tokens, lane)
        out.append((clock.now(), i, lane))

    await asyncio.gather(*(one(i, t, lane) for i, (t, lane) in enumerate(calls)))
    return out


async def test_sub_minute_enforcement_60_rpm_is_one_per_second() -> None:
    clock = FakeClock()
    limiter = exact(rpm=60, burst_s=1.0, clock=clock)
    grants = await _grants(limiter, clock, [(0, Lane.LIVE)] * 5)
    times = [t - 1000.0 for t, _, _ in grants]
    assert times == pytest.approx([0, 1, 2, 3, 4])


async def test_tokens_per_minute_bound_big_requests() -> None:
    clock = FakeClock()
    limiter = exact(rpm=10_000, tpm=6000, burst_s=1.0, clock=clock)  # 100 tokens/s
    grants = await _grants(limiter, clock, [(100, Lane.LIVE)] * 4)
    assert [round(t - 1000.0, 6) for t, _, _ in grants] == [0, 1, 2, 3]


async def test_reconcile_returns_unused_tokens() -> None:
    clock = FakeClock()
    limiter = exact(rpm=10_000, tpm=6000, clock=clock)
    permit = await limiter.acquire(100)
    permit.reconcile(20)  # the call used 20 of the 100 estimated
    await limiter.acquire(80)
    assert clock.now() == 1000.0  # no wait: 80 tokens were given back


async def test_live_lane_goes_before_a_queued_replay_backlog() -> None:
    clock = FakeClock()
    limiter = exact(rpm=60, clock=clock)
    await limiter.acquire(0, Lane.REPLAY)  # empties the bucket
    replay = [asyncio.ensure_future(limiter.acquire(0, Lane.REPLAY)) for _ in range(20)]
    await asyncio.sleep(0)
    live_started = clock.now()
    await limiter.acquire(0, Lane.LIVE)
    assert clock.now() - live_started <= 1.0 + 1e-9  # about one request slot
    assert sum(f.done() for f in replay) <= 1
    await asyncio.gather(*replay)


async def test_429_cuts_the_rate_pauses_and_recovers_additively() -> None:
    clock = FakeClock()
    limiter = exact(rpm=600, clock=clock, decrease=0.5, recover_per_s=0.1)
    limiter.throttled(retry_after_s=2.0)
    assert limiter.snapshot().rpm == 300
    start = clock.now()
    await limiter.acquire()
    assert clock.now() - start >= 2.0  # Retry-After honoured by every caller
    clock.advance(10)
    await limiter.acquire()
    assert limiter.snapshot().rpm == 600  # back to the ceiling, additively


@pytest.mark.parametrize("said", [9 * 3600.0, 1e9])
async def test_a_429s_wait_pauses_every_call_ten_minutes_at_most(said: float) -> None:
    """A daily quota's "come back in 9 hours", a gateway's `retry-after: 1e9`: every call
    waited until then — the endpoint unasked for hours, or for ever, whatever it did
    meanwhile. After ten minutes one call asks again (and learns the wait anew)."""
    from streams.resilience.limiter import MAX_PAUSE_S

    clock = FakeClock()
    limiter = exact(rpm=600, clock=clock)
    limiter.throttled(retry_after_s=said)
    assert limiter.snapshot().paused_for_s == MAX_PAUSE_S == 600.0
    start = clock.now()
    await limiter.acquire()
    assert clock.now() - start == pytest.approx(MAX_PAUSE_S, abs=1.0)


async def test_headers_set_the_ceiling_and_the_shared_remaining() -> None:
    clock = FakeClock()
    limiter = exact(rpm=6000, clock=clock)
    limiter.observe({"x-ratelimit-limit-requests": "600", "x-ratelimit-remaining-requests": "0"})
    snap = limiter.snapshot()
    assert snap.rpm_ceiling == 600 and snap.rpm == 600
    start = clock.now()
    await limiter.acquire()  # the provider said nothing is left: wait for a refill
    assert clock.now() - start == pytest.approx(0.1)


@pytest.mark.parametrize(
    "said",
    [
        {"x-ratelimit-limit-requests": "1e-322"},  # a rate of 0 a second: a division by 0
        {"x-ratelimit-limit-requests": "nan", "x-ratelimit-remaining-requests": "nan"},
        {"x-ratelimit-limit-requests": "inf", "x-ratelimit-remaining-requests": "inf"},
        {"x-ratelimit-remaining-requests": "-3", "x-ratelimit-reset-requests": "-1"},
        {"x-ratelimit-limit-tokens": "0.5", "x-ratelimit-remaining-tokens": "1e999"},
    ],
)
async def test_headers_that_say_no_number_a_limit_can_be_are_not_followed(
    said: dict[str, str],
) -> None:
    """A gateway's nonsense is no limit: the limiter keeps the last it knew, and grants
    (before, `1e-322` divided by zero in the next wait, `nan` compared false forever, `inf`
    admitted everything). A negative `remaining` (past the limit) is none left."""
    clock = FakeClock()
    limiter = exact(rpm=600, clock=clock)
    limiter.observe(said, await limiter.acquire())
    snap = limiter.snapshot()
    assert snap.rpm_ceiling == 600 and snap.rpm == 600 and limiter.tokens is None
    start = clock.now()
    await limiter.acquire()  # the next call goes within a refill (0.1 s at 600/min)
    assert clock.now() - start <= 0.1 + 1e-9


@pytest.mark.parametrize(
    ("remaining", "reset", "left"),
    [
        ("2400", "12s", 40.0),  # counted against the minute (OpenAI): 2400/60 of a second's 50
        ("1500", "30s", 25.0),  # the minute, half used by another client of the key
        ("40", "200ms", 40.0),  # counted against the enforcing second (some gateways)
        ("10", "800ms", 10.0),  # the second, mostly used
    ],
)
def test_remaining_is_read_against_the_window_it_is_counted_in(
    remaining: str, reset: str, left: float
) -> None:
    """3,000 RPM enforced per second (50 a second): whichever window the provider counts
    `remaining` against, the bucket keeps exactly what the provider has left."""
    limiter = exact(rpm=None, clock=FakeClock())
    limiter.observe({"x-ratelimit-limit-requests": "3000",
                     "x-ratelimit-remaining-requests": remaining,
                     "x-ratelimit-reset-requests": reset})  # fmt: skip
    assert limiter.requests.level == pytest.approx(left, abs=0.6)


def test_the_largest_remaining_seen_tells_the_window_without_reset_headers() -> None:
    limiter = exact(rpm=None, clock=FakeClock())
    for remaining in ("49", "30", "12"):  # a per-second window: never more than 50 left
        limiter.observe({"x-ratelimit-limit-requests": "3000",
                         "x-ratelimit-remaining-requests": remaining})  # fmt: skip
    assert limiter.requests.level == pytest.approx(12.0)  # not 12/60 of a second's worth


async def test_a_report_counts_the_refill_and_our_grants_since_its_call() -> None:
    """3,000 RPM (50 a second): the answer's `remaining` is as old as its call. Half a
    second later the provider has refilled 25 and taken the 5 we granted meanwhile."""
    clock = FakeClock()
    limiter = exact(rpm=3000, clock=clock)
    for _ in range(45):
        await limiter.acquire()
    permit = await limiter.acquire()  # the provider had 4 left after this one
    clock.advance(0.5)
    for _ in range(5):
        await limiter.acquire()
    limiter.observe({"x-ratelimit-limit-requests": "3000",
                     "x-ratelimit-remaining-requests": "4",
                     "x-ratelimit-reset-requests": "920ms"}, permit)  # fmt: skip
    assert limiter.requests.level == pytest.approx(4 + 25 - 5)
    limiter.observe({"x-ratelimit-remaining-requests": "0",
                     "x-ratelimit-reset-requests": "1s"}, permit)  # fmt: skip
    assert limiter.requests.level == pytest.approx(0 + 25 - 5)  # a neighbour took 4 more


async def test_a_neighbour_on_the_key_is_seen_in_the_trend_of_remaining() -> None:
    """3,000 RPM (50 a second). Every half second the provider refills 25 and we take
    15, yet it reports the same 20 left: another client of the key takes 10 (20 a
    second). Our share becomes what it leaves, 30 a second; when the neighbour leaves
    (we take all 25), it is seen gone."""
    clock = FakeClock()
    limiter = exact(rpm=3000, clock=clock, recover_per_s=0.0)
    report = {"x-ratelimit-limit-requests": "3000", "x-ratelimit-remaining-requests": "20",
              "x-ratelimit-reset-requests": "600ms"}  # fmt: skip

    async def steps(n: int, ours: int) -> None:
        for _ in range(n):
            permit = await limiter.acquire()
            limiter.observe(report, permit)
            limiter.requests.taken += ours - 1  # our other grants until the next report
            clock.advance(0.5)

    await steps(30, ours=15)
    assert limiter.requests.others_per_s == pytest.approx(20, rel=0.05)
    assert limiter.snapshot().rpm == pytest.approx(1800, rel=0.05)
    await steps(30, ours=25)
    assert limiter.requests.others_per_s == pytest.approx(0, abs=0.5)


async def test_a_share_held_small_by_a_neighbour_grows_back_when_the_key_is_idle() -> None:
    """A neighbour took 40 a second (of 50) and left: we are held to 10 a second and,
    taking 2 between reports, never drain the provider's bucket enough to measure the
    neighbour's absence. The provider reporting its bucket full says the key is idle."""
    clock = FakeClock()
    limiter = exact(rpm=3000, clock=clock, recover_per_s=0.0)
    limiter.requests.others_mean = 40.0
    limiter.requests.set_rate(limiter.share(limiter.requests, 3000), clock.now())
    assert limiter.snapshot().rpm == pytest.approx(600)
    for _ in range(120):
        permit = await limiter.acquire()
        limiter.observe({"x-ratelimit-limit-requests": "3000",
                         "x-ratelimit-remaining-requests": "48",
                         "x-ratelimit-reset-requests": "40ms"}, permit)  # fmt: skip
        limiter.requests.taken += 1
        clock.advance(0.2)
    assert limiter.requests.others_per_s < 0.5
    assert limiter.share(limiter.requests, 3000) == pytest.approx(3000, rel=0.01)
    assert limiter.snapshot().rpm == pytest.approx(3000, rel=0.01)  # no 429: at once


async def test_a_fixed_window_is_not_mistaken_for_a_neighbour() -> None:
    """A one-minute window does not refill as time passes: `remaining` falls by what we
    take while its reset counts down with the clock. That is no other client."""
    clock = FakeClock()
    limiter = exact(rpm=3000, clock=clock, recover_per_s=0.0)
    remaining, reset = 3000, 60.0
    for _ in range(40):
        permit = await limiter.acquire()
        remaining -= 10
        limiter.observe({"x-ratelimit-limit-requests": "3000",
                         "x-ratelimit-remaining-requests": str(remaining),
                         "x-ratelimit-reset-requests": f"{reset:.3f}s"}, permit)  # fmt: skip
        limiter.requests.taken += 9
        clock.advance(0.2)
        reset -= 0.2
    assert limiter.requests.fixed_window
    assert limiter.requests.others_per_s == 0
    assert limiter.snapshot().rpm == 3000


async def test_a_burst_of_429s_cuts_the_rate_once() -> None:
    clock = FakeClock()
    limiter = exact(rpm=600, clock=clock, decrease=0.5, recover_per_s=0.0)
    burst = [await limiter.acquire() for _ in range(5)]  # let go together at the old rate
    for permit in burst:
        limiter.throttled(retry_after_s=None, permit=permit)
    assert limiter.snapshot().rpm == 300  # once, not 600 * 0.5**5
    clock.advance(0.1)
    later = await limiter.acquire()  # let go after the cut: a new event
    limiter.throttled(retry_after_s=None, permit=later)
    assert limiter.snapshot().rpm == 150


async def test_unused_tokens_go_back_only_when_the_provider_does_not_report_its_own_count(
) -> None:  # fmt: skip
    clock = FakeClock()
    silent = exact(rpm=10_000, tpm=6000, clock=clock)
    (await silent.acquire(500)).reconcile(100)  # 400 of the estimate unused: given back
    assert silent.tokens is not None and silent.tokens.level == pytest.approx(0.0)
    told = exact(rpm=10_000, tpm=6000, clock=clock)
    permit = await told.acquire(500)
    # The provider charged the prompt and the whole completion budget, and says so.
    told.observe({"x-ratelimit-limit-tokens": "6000", "x-ratelimit-remaining-tokens": "0",
                  "x-ratelimit-reset-tokens": "5s"})  # fmt: skip
    level = told.tokens.level if told.tokens is not None else None
    permit.reconcile(100)
    assert told.tokens is not None and told.tokens.level == level  # nothing given back


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError):
        RateLimiter(rpm=0)


async def test_default_margins_stay_inside_the_providers_bucket() -> None:
    clock = FakeClock()
    limiter = RateLimiter(rpm=1200, clock=clock)  # provider: 20/s, bursts of 20
    grants = await _grants(limiter, clock, [(0, Lane.LIVE)] * 60)
    times = [t - 1000.0 for t, _, _ in grants]
    assert sum(1 for t in times if t == 0) == 19  # one unit of burst headroom
    assert 0.99 * 20 <= (60 - 19) / times[-1] <= 20  # 99.5% of the rate after the burst


@settings(max_examples=40, deadline=None)
@given(
    rpm=st.integers(30, 20_000),
    burst=st.floats(0.2, 5.0),
    calls=st.integers(1, 80),
    gaps=st.lists(st.floats(0, 0.5), min_size=80, max_size=80),
)
def test_never_admits_more_than_the_rate_over_any_window(
    rpm: int, burst: float, calls: int, gaps: list[float]
) -> None:
    async def run() -> list[float]:
        clock = FakeClock()
        limiter = exact(rpm=rpm, burst_s=burst, clock=clock)
        times = []
        for i in range(calls):
            clock.advance(gaps[i])
            await limiter.acquire()
            times.append(clock.now())
        return times

    times = asyncio.run(run())
    capacity = max(1.0, rpm * burst / 60)
    for i, start in enumerate(times):
        for j in range(i, len(times)):
            window = times[j] - start
            admitted = j - i + 1
            assert admitted <= capacity + window * rpm / 60 + 1e-6


async def test_unknown_limit_sends_one_call_first_then_follows_the_headers() -> None:
    clock = FakeClock()
    limiter = exact(rpm=None, clock=clock)
    first = await limiter.acquire(100)
    others = [asyncio.ensure_future(limiter.acquire(100)) for _ in range(5)]
    for _ in range(5):
        await asyncio.sleep(0)
    assert not any(f.done() for f in others)  # slow start: nothing else until we learn
    limiter.observe(
        {
            "x-ratelimit-limit-requests": "120",
            "x-ratelimit-remaining-requests": "119",
            "x-ratelimit-limit-tokens": "60000",
            "x-ratelimit-remaining-tokens": "59000",
        }
    )
    first.reconcile(100)
    await asyncio.gather(*others)
    snap = limiter.snapshot()
    assert snap.rpm_ceiling == 120 and snap.tpm_ceiling == 60000
    assert clock.now() - 1000.0 >= 1.5  # 2/s after the first: the other 5 took > 1.5 s


async def test_unknown_limit_without_headers_becomes_unlimited() -> None:
    clock = FakeClock()
    limiter = exact(rpm=None, clock=clock)
    (await limiter.acquire()).reconcile(0)
    await asyncio.gather(*(limiter.acquire() for _ in range(50)))
    assert clock.now() - 1000.0 < 0.2


async def test_a_429_from_an_informed_provider_cuts_gently_both_buckets() -> None:
    clock = FakeClock()
    limiter = exact(rpm=None, clock=clock)
    limiter.observe({"x-ratelimit-limit-requests": "600", "x-ratelimit-limit-tokens": "60000"})
    limiter.throttled(retry_after_s=1.0)
    snap = limiter.snapshot()
    assert snap.rpm == pytest.approx(540) and snap.tpm == pytest.approx(54000)  # x0.9, not x0.7
    uninformed = exact(rpm=600, tpm=60000, clock=clock)
    uninformed.throttled(retry_after_s=None)
    assert uninformed.snapshot().rpm == pytest.approx(
        420
    ) and uninformed.snapshot().tpm == pytest.approx(42000)


async def test_a_group_member_claims_its_part_of_the_group_whatever_the_trend_says() -> None:
    """Every split of the key that sums to the limit fits it; a member of a consumer group
    holding a quarter of its partitions claims at least a quarter, and what the others
    leave beyond that."""
    clock = FakeClock()
    group = GroupShare()
    limiter = exact(rpm=3000, clock=clock, recover_per_s=0.0, group=group)
    group.assigned(2, 8)
    limiter._follow_group(clock.now())  # (seen at the limiter's next grant or report)
    # Before the trend is measured, the other members are due theirs: no burst of all
    # four at the whole limit when a phase starts.
    assert limiter.share(limiter.requests, 3000) == pytest.approx(750)
    limiter.requests.sampled = True
    limiter.requests.others_mean = 45.0  # the others seem to take 2,700 of 3,000 a minute
    assert limiter.share(limiter.requests, 3000) == pytest.approx(750)
    limiter.requests.others_mean = 10.0  # they take little: more than our part is ours
    assert limiter.share(limiter.requests, 3000) == pytest.approx(2400)
    group.assigned(8, 8)  # alone in the group: the trend alone tells the others
    limiter._follow_group(clock.now())
    assert group.fraction is None
    assert limiter.share(limiter.requests, 3000) == 3000  # not measured since
    limiter.requests.sampled, limiter.requests.others_mean = True, 45.0
    assert limiter.share(limiter.requests, 3000) == pytest.approx(300)


async def test_a_refused_call_is_not_counted_among_what_we_took() -> None:
    """A 429 was not charged by the provider: counting it as ours would read the others
    as taking that much less."""
    limiter = exact(rpm=3000, tpm=100_000, clock=FakeClock())
    permits = [await limiter.acquire(100) for _ in range(3)]
    limiter.throttled(retry_after_s=None, permit=permits[1])
    assert limiter.requests.taken == 2
    assert limiter.tokens is not None and limiter.tokens.taken == 200


async def test_after_a_rebalance_the_others_are_measured_again() -> None:
    """A worker alone on the key is joined by a second: until it has measured the
    newcomer it claims its half, not the whole key it had. When the newcomer leaves
    again, it claims the whole key at once, not after its estimate of it has decayed."""
    clock = FakeClock()
    group = GroupShare()
    limiter = exact(rpm=3000, clock=clock, group=group)
    group.assigned(8, 8)
    limiter._follow_group(clock.now())
    limiter.requests.sampled = True
    assert limiter.share(limiter.requests, 3000) == 3000
    group.assigned(4, 8)
    limiter._follow_group(clock.now())
    assert limiter.share(limiter.requests, 3000) == pytest.approx(1500)
    limiter.requests.sampled, limiter.requests.others_mean = True, 25.0
    group.assigned(8, 8)
    limiter._follow_group(clock.now())
    assert limiter.share(limiter.requests, 3000) == 3000


async def test_after_a_rebalance_the_first_sample_does_not_read_the_others_as_gone() -> None:
    """The trend's moving average starts from what the other members are due: one sample
    of them taking their half leaves this worker at its half, where an average started
    from nothing would read them as taking a fifth of it and leap to 2,700 of 3,000."""
    clock = FakeClock()
    group = GroupShare()
    limiter = exact(rpm=3000, clock=clock, group=group)
    group.assigned(4, 8)
    limiter._follow_group(clock.now())
    bucket = limiter.requests
    assert limiter.share(bucket, 3000) == pytest.approx(1500)  # the rebalance is seen
    # Two reports 0.1 s apart: the provider refilled 5, we took 2.5, the others 2.5.
    bucket.sample_others(3000, Granted(1000.0, 0.0), 10.0, None)
    bucket.sample_others(3000, Granted(1000.1, 2.5), 10.0, None)
    assert bucket.sampled
    assert limiter.share(bucket, 3000) == pytest.approx(1500)
    group.assigned(8, 8)  # alone again: nobody else is due anything
    limiter._follow_group(clock.now())
    assert limiter.share(bucket, 3000) == 3000 and bucket.others_mean == 0.0


async def test_a_report_of_a_call_granted_before_a_rebalance_is_no_sample_of_the_new_group() -> (
    None
):
    """A call let go before a member joined is answered after: its report still steers
    the level, but the new group's trend starts from the first call granted since (else
    the old group's pace would be read as the new one's)."""
    clock = FakeClock()
    group = GroupShare()
    limiter = exact(rpm=3000, clock=clock, group=group)
    report = {"x-ratelimit-limit-requests": "3000", "x-ratelimit-remaining-requests": "20",
              "x-ratelimit-reset-requests": "600ms"}  # fmt: skip
    before = await limiter.acquire()
    clock.advance(0.5)
    group.assigned(4, 8)  # a member joins while the call is out
    limiter.observe(report, before)
    bucket = limiter.requests
    assert bucket.last_report is None and not bucket.sampled
    assert limiter.informed  # the report itself was read
    assert limiter.share(bucket, 3000) == pytest.approx(1500)  # our half meanwhile
    after = await limiter.acquire()
    limiter.observe(report, after)
    assert bucket.last_report is not None and bucket.last_report.granted_at == after.granted_at


async def test_a_member_joining_brings_the_rate_down_before_the_next_grant() -> None:
    """A worker alone on the key runs at all of it with a full bucket; when a second
    member joins, its next grants follow its half at once (no full bucket spent beside
    the newcomer's), not only once the provider's next report comes."""
    clock = FakeClock()
    group = GroupShare()
    limiter = exact(rpm=3000, clock=clock, group=group)  # 50/s, a bucket of 50
    group.assigned(8, 8)
    clock.advance(1.0)
    group.assigned(4, 8)
    clock.advance(0.01)
    await asyncio.gather(*(limiter.acquire() for _ in range(40)))
    assert limiter.snapshot().rpm == pytest.approx(1500)
    # A bucket of 25 at once, then 25/s: the other 15 took 0.6 s, not nothing.
    assert clock.now() - 1001.01 == pytest.approx(0.6, abs=0.05)


async def test_only_a_waiter_that_goes_first_wakes_the_sleeping_pump() -> None:
    """A backlog held by the limit: each new waiter queues behind the head, and the pump
    sleeps on for the head. Only one that goes before it (live before replay) wakes it."""
    limiter = exact(rpm=1)  # the real clock: the pump sleeps a minute for the head
    await limiter.acquire(0, Lane.REPLAY)  # empties the bucket
    wakes: list[int] = []
    real_wake = limiter._wake

    def counted_wake() -> None:
        wakes.append(len(limiter._queue))
        real_wake()

    limiter._wake = counted_wake  # type: ignore[method-assign]
    head = asyncio.ensure_future(limiter.acquire(0, Lane.REPLAY))
    await asyncio.sleep(0.01)  # the pump runs and sleeps for the head
    behind = [asyncio.ensure_future(limiter.acquire(0, Lane.REPLAY)) for _ in range(5)]
    await asyncio.sleep(0.01)
    assert wakes == []  # the pump slept through them
    live = asyncio.ensure_future(limiter.acquire(0, Lane.LIVE))
    await asyncio.sleep(0.01)
    assert wakes == [7]  # the live call goes first: woken once, to sleep for it
    assert not any(f.done() for f in [head, live, *behind])
    for f in [head, live, *behind]:
        f.cancel()
    assert limiter._pump is not None
    limiter._pump.cancel()
    await asyncio.gather(head, live, *behind, limiter._pump, return_exceptions=True)


async def test_on_the_real_clock_the_pump_sleeps_on_a_loop_timer_and_grants_in_order() -> None:
    """The pump's sleep is one loop timer on the real clock: a backlog held by 1,200 RPM
    (20/s, a burst of one) is granted one by one, in order, and the pump ends with it."""
    limiter = exact(rpm=1200, burst_s=0.05)
    order: list[int] = []

    async def one(i: int) -> None:
        await limiter.acquire()
        order.append(i)

    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(4))), 5)
    assert order == [0, 1, 2, 3]
    assert limiter._pump is not None
    await asyncio.wait_for(limiter._pump, 1)  # the queue is empty: the pump is done
    assert limiter._woken is None


async def test_a_limit_measured_at_a_429_creeps_only_while_calls_wait_at_it() -> None:
    """A provider that says no limit: its 429 sets the ceiling to the pace it answered.
    An hour of calm with no call waiting leaves it there (it used to compound towards
    infinity); never above "unlimited"."""
    clock = FakeClock()
    limiter = RateLimiter(rpm=None, clock=clock)
    (await limiter.acquire()).reconcile(0)  # the probe's answer, with no headers
    permits = [await limiter.acquire() for _ in range(30)]
    clock.advance(1.0)
    limiter.throttled(retry_after_s=0.5, permit=permits[-1])
    assert limiter.measured and limiter.rpm_ceiling == pytest.approx(29 * 60, rel=0.05)
    measured = limiter.rpm_ceiling
    clock.advance(3600)
    await limiter.acquire()  # nobody waiting: no creep
    assert limiter.rpm_ceiling == measured
    told = RateLimiter(rpm=600, clock=clock)
    p = await told.acquire()
    told.throttled(retry_after_s=None, permit=p)
    assert not told.measured and told.rpm_ceiling == 600  # a limit given is not re-measured


async def test_a_request_limit_not_said_is_measured_at_its_429s() -> None:
    """`remaining` alone marked the provider as one that says its limit: its 429s only
    nudged an 'unlimited' rate down by 10% a burst and never measured it — 56% of the
    calls refused against Azure's headers (bench/rate_limit_shapes.py, phase 9)."""
    clock = FakeClock()
    limiter = RateLimiter(rpm=None, clock=clock)
    first = await limiter.acquire()
    # Azure OpenAI: what is left, and not of what.
    said = {"x-ratelimit-remaining-requests": "79", "x-ratelimit-remaining-tokens": "61353"}
    limiter.observe(said, first)
    assert not limiter.probing  # the first answer came: no longer one call at a time
    permits = [await limiter.acquire() for _ in range(30)]
    clock.advance(1.0)
    limiter.throttled(retry_after_s=0.5, permit=permits[-1])
    assert limiter.measured and limiter.rpm_ceiling == pytest.approx(30 * 60, rel=0.1)
    assert limiter.snapshot().rpm <= limiter.rpm_ceiling


GROQ = {  # Groq's headers: the request ones a day's quota, the token ones per minute
    "x-ratelimit-limit-requests": "14400", "x-ratelimit-remaining-requests": "14370",
    "x-ratelimit-reset-requests": "2m59.56s", "x-ratelimit-limit-tokens": "18000",
    "x-ratelimit-remaining-tokens": "17997", "x-ratelimit-reset-tokens": "7.66s",
}  # fmt: skip


async def test_a_request_limit_said_in_a_429s_body_holds_over_a_days_quota_in_the_headers() -> None:
    """Groq says its per-minute request limit only in its 429s' words; its headers' request
    limit is per day. The day's 14,400 was taken for a per-minute pace, and the 429s of the
    real 30 RPM were cut gently from there, never learned."""
    clock = FakeClock()
    limiter = RateLimiter(rpm=None, clock=clock)
    first = await limiter.acquire(10)
    limiter.observe(GROQ, first)
    first.reconcile(10)
    assert limiter.rpm_ceiling == 14400
    permits = [await limiter.acquire(10) for _ in range(5)]
    limiter.observe(GROQ, permits[-1])
    limiter.throttled(2.0, permits[-1], LimitHit("requests", 60, 30))
    assert limiter.rpm_ceiling == 30 and limiter.snapshot().rpm <= 30
    clock.advance(120)
    later = await limiter.acquire(10)
    limiter.observe(GROQ, later)  # the day's figure again: not a per-minute limit
    clock.advance(60)
    await limiter.acquire(10)
    assert limiter.rpm_ceiling == 30 and limiter.snapshot().rpm <= 30
    assert limiter.tpm_ceiling == 18000  # the token limit, said per minute, stands


async def test_a_429_of_the_token_limit_cuts_the_tokens_alone() -> None:
    clock = FakeClock()
    limiter = exact(rpm=None, clock=clock)
    limiter.observe({"x-ratelimit-limit-requests": "600", "x-ratelimit-limit-tokens": "60000"})
    limiter.throttled(1.0, None, LimitHit("tokens", 60, 60000))
    snap = limiter.snapshot()
    assert snap.rpm == pytest.approx(600) and snap.tpm == pytest.approx(54000)
    limiter.throttled(1.0, None, LimitHit("requests", 60, 600))
    clock.advance(0.5)  # (a later burst: a new cut)
    limiter.throttled(1.0, None, LimitHit("requests", 60, 600))
    assert limiter.snapshot().tpm == pytest.approx(54000)  # untouched by the requests'


async def test_a_token_limit_named_and_never_said_is_measured() -> None:
    """Azure OpenAI says `remaining` alone and words its 429s "token rate limit": its token
    429s were read as a request pace (the request ceiling measured, the tokens unbounded:
    2.32% of calls refused where its TPM binds, bench/rate_limit_shapes.py phase 10)."""
    clock = FakeClock()
    limiter = RateLimiter(rpm=None, clock=clock)
    first = await limiter.acquire(1000)
    limiter.observe({"x-ratelimit-remaining-requests": "79"}, first)  # (no token figure)
    permits = [await limiter.acquire(1000) for _ in range(20)]
    clock.advance(1.0)
    limiter.throttled(1.0, permits[-1], LimitHit("tokens", 60))
    assert limiter.tokens is not None and limiter.tokens_measured
    assert limiter.tpm_ceiling == pytest.approx(20 * 1000 * 60, rel=0.1)
    assert not limiter.measured and limiter.rpm_ceiling == 1_000_000  # no request limit hit


async def test_a_request_limit_named_beside_a_said_token_limit_is_measured() -> None:
    """Cerebras says its token limit per minute, and its request limit only in the words
    of its 429s: those are measured; an unnamed 429 there is taken as the tokens'."""
    clock = FakeClock()
    limiter = RateLimiter(rpm=None, clock=clock)
    said = {"x-ratelimit-limit-tokens": "60000", "x-ratelimit-remaining-tokens": "59000"}
    limiter.observe(said, await limiter.acquire(100))
    permits = [await limiter.acquire(100) for _ in range(10)]
    clock.advance(1.0)
    limiter.throttled(1.0, permits[-1])  # unnamed
    assert not limiter.measured
    clock.advance(2.0)
    limiter.throttled(1.0, await limiter.acquire(100), LimitHit("requests", 60))
    assert limiter.measured and limiter.rpm_ceiling < 1_000_000


async def test_a_days_quota_spent_pauses_and_cuts_nothing() -> None:
    clock = FakeClock()
    limiter = exact(rpm=600, clock=clock)
    permit = await limiter.acquire()
    limiter.throttled(30.0, permit, LimitHit("requests", 86400, 14400))
    snap = limiter.snapshot()
    assert snap.rpm == 600 and snap.paused_for_s == pytest.approx(30.0)
    assert not limiter.measured


async def test_a_limit_said_alike_in_headers_and_body_follows_the_headers_when_it_grows() -> None:
    """OpenAI says its request limit in both: a 429's figure that agrees with the headers
    marks nothing, and a limit raised later (a higher tier) is taken from the headers."""
    clock = FakeClock()
    limiter = RateLimiter(rpm=None, clock=clock)
    said = {"x-ratelimit-limit-requests": "3000", "x-ratelimit-remaining-requests": "2999"}
    first = await limiter.acquire()
    limiter.observe(said, first)
    limiter.throttled(1.0, first, LimitHit("requests", 60, 3000))
    assert limiter.rpm_ceiling == 3000
    raised = {"x-ratelimit-limit-requests": "5000", "x-ratelimit-remaining-requests": "4999"}
    clock.advance(5.0)
    limiter.observe(raised, await limiter.acquire())
    assert limiter.rpm_ceiling == 5000


async def test_a_token_limit_never_said_starts_at_what_the_first_answer_leaves() -> None:
    """Azure OpenAI says what is left of its tokens (against the minute) and not of what:
    the limiter started 'unlimited', and a worker's first burst met a wall of 429s (57 in
    a minute where 6 came after: the simulator in Azure's style, TPM binding)."""
    clock = FakeClock()
    limiter = RateLimiter(rpm=None, clock=clock)
    refused = await limiter.acquire(700)
    limiter.observe({"x-ratelimit-remaining-tokens": "0"}, refused, refused=True)
    assert limiter.tokens is None  # a 429's report: no start from it
    first = await limiter.acquire(700)
    limiter.observe({"x-ratelimit-remaining-requests": "59",
                     "x-ratelimit-remaining-tokens": "524300"}, first)  # fmt: skip
    assert limiter.tokens is not None and limiter.tpm_ceiling == 525_000
    assert limiter.tokens_measured  # measured again at its 429s, and creeps
