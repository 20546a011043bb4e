"""The numbers a provider's headers say: limits, what is left, when to come back."""

from __future__ import annotations

import pytest

from streams.dev.simulator import SimulatorServer
from streams.llm.client import LLMResponse
from streams.llm.openai_client import OpenAIClient
from streams.llm.ratelimit_headers import delay, number, openai_names, seconds
from streams.resilience.limiter import RateLimiter
from tests.fakes import SIM_REQUEST

NOW = 1_796_468_400.0  # Sat, 05 Dec 2026 11:00:00 GMT


@pytest.mark.parametrize(
    ("said", "found"),
    [("600", 600.0), ("1.5", 1.5), ("-3", 0.0), ("nan", None), ("inf", None), ("1e999", None),
     ("many", None), (None, None)],
)  # fmt: skip
def test_a_number_is_finite_and_at_least_zero(said: str | None, found: float | None) -> None:
    assert number(said) == found


@pytest.mark.parametrize(
    ("said", "found"),
    [("6m0s", 360.0), ("1.5s", 1.5), ("20ms", 0.02), ("1h", 3600.0), ("12", 12.0), ("soon", None)],
)
def test_a_reset_in_openais_duration_form_or_in_seconds(said: str, found: float | None) -> None:
    assert seconds(said) == found


@pytest.mark.parametrize(
    ("said", "found"),
    [
        ("30", 30.0),
        ("Sat, 05 Dec 2026 11:00:30 GMT", 30.0),  # RFC 9110: an HTTP date
        ("Sat, 05 Dec 2026 10:59:00 GMT", 0.0),  # passed: at once
        ("Sat, 05 Dec 2026 11:00:30", None),  # no zone: no telling when
        ("tomorrow", None),
        ("", None),
    ],
)
def test_retry_after_is_seconds_or_an_http_date(said: str, found: float | None) -> None:
    assert delay(said, now=NOW) == found


NEW_YEAR = 1_767_225_600.0  # 2026-01-01T00:00:00Z


def test_other_providers_headers_read_in_openais_names() -> None:
    """Anthropic's and Cerebras' rate-limit headers were dropped (only `x-ratelimit-*`
    with OpenAI's names was read): a limit they said was learned from 429s alone."""
    anthropic = {
        "Anthropic-RateLimit-Requests-Limit": "1000",
        "anthropic-ratelimit-requests-remaining": "999",
        "anthropic-ratelimit-requests-reset": "2026-01-01T00:00:02Z",
        "anthropic-ratelimit-tokens-limit": "96000",
        "anthropic-ratelimit-tokens-remaining": "95000",
        "anthropic-ratelimit-tokens-reset": "2026-01-01T01:00:00+01:00",  # now: full
        "anthropic-ratelimit-input-tokens-limit": "80000",  # within `tokens`
        "request-id": "req_1",
    }
    assert openai_names(anthropic, NEW_YEAR) == {
        "x-ratelimit-limit-requests": "1000", "x-ratelimit-remaining-requests": "999",
        "x-ratelimit-reset-requests": "2.000", "x-ratelimit-limit-tokens": "96000",
        "x-ratelimit-remaining-tokens": "95000", "x-ratelimit-reset-tokens": "0.000",
    }  # fmt: skip
    cerebras = {
        "x-ratelimit-limit-requests-day": "14400",  # a day's quota: no per-minute rate
        "x-ratelimit-remaining-requests-day": "14000",
        "x-ratelimit-reset-requests-day": "33011.4",
        "x-ratelimit-limit-tokens-minute": "60000",
        "x-ratelimit-remaining-tokens-minute": "59000",
        "x-ratelimit-reset-tokens-minute": "11.4",
    }
    assert openai_names(cerebras, NEW_YEAR) == {
        "x-ratelimit-limit-tokens": "60000", "x-ratelimit-remaining-tokens": "59000",
        "x-ratelimit-reset-tokens": "11.4",
    }  # fmt: skip
    openai = {"X-RateLimit-Limit-Requests": "500", "x-ratelimit-reset-requests": "6m0s",
              "x-ratelimit-limit-tokens_usage_based": "160000"}  # fmt: skip
    assert openai_names(openai, NEW_YEAR) == {"x-ratelimit-limit-requests": "500",
                                               "x-ratelimit-reset-requests": "6m0s"}  # fmt: skip
    # Mistral's (as it sends them): its requests as `req`, per minute; its monthly quotas
    # and a call's cost are no rate. Before, `-req-minute` and `-tokens-month` went on as
    # `x-ratelimit-limit-*` names the limiter reads none of: its request limit (the one
    # that binds first: 720 calls against 5,000,000 tokens a minute) was never learned.
    mistral = {
        "x-ratelimit-limit-tokens-minute": "5000000",
        "x-ratelimit-remaining-tokens-minute": "4999911",
        "x-ratelimit-tokens-query-cost": "52",
        "x-ratelimit-limit-req-minute": "720",
        "x-ratelimit-remaining-req-minute": "717",
        "x-ratelimit-limit-tokens-month": "1000000000",
        "x-ratelimit-remaining-tokens-month": "999000000",
    }
    assert openai_names(mistral, NEW_YEAR) == {
        "x-ratelimit-limit-tokens": "5000000", "x-ratelimit-remaining-tokens": "4999911",
        "x-ratelimit-limit-requests": "720", "x-ratelimit-remaining-requests": "717",
    }  # fmt: skip
    # OpenAI's own name wins; a reset that is no time (or in no zone) is left out.
    mixed = {"x-ratelimit-limit-requests": "500", "anthropic-ratelimit-requests-limit": "9",
             "anthropic-ratelimit-requests-reset": "soon",
             "anthropic-ratelimit-tokens-reset": "2026-01-01T00:00:09"}  # fmt: skip
    assert openai_names(mixed, NEW_YEAR) == {"x-ratelimit-limit-requests": "500"}


async def first_answer(simulator: SimulatorServer, style: str) -> tuple[RateLimiter, LLMResponse]:
    """A limiter told no limit, after the first answer of the simulator speaking `style`
    (600 RPM, 90,000 TPM) taught it."""
    simulator.sim.config.update({"rpm": 600, "tpm": 90_000, "header_style": style})
    client = OpenAIClient(base_url=simulator.base_url, api_key="k", connect_timeout_s=1,
                          read_timeout_s=2)  # fmt: skip
    limiter = RateLimiter(rpm=None)
    try:
        permit = await limiter.acquire(50)
        answer = await client.complete(SIM_REQUEST)
    finally:
        await client.close()
    limiter.observe(answer.rate_headers, permit)
    return limiter, answer


@pytest.mark.parametrize("style", ["openai", "anthropic", "cerebras", "mistral"])
async def test_a_limit_said_in_any_providers_headers_is_learned(
    simulator: SimulatorServer, style: str
) -> None:
    """Through the simulator speaking each provider's headers, the client and a limiter
    told no limit: the first answer teaches the token limit, as OpenAI's headers do (and
    the request limit where the provider says one per minute)."""
    limiter, answer = await first_answer(simulator, style)
    assert limiter.informed and limiter.tpm_ceiling == 90_000
    assert float(answer.rate_headers["x-ratelimit-remaining-tokens"]) < 90_000
    if style != "mistral":  # it says no reset
        assert 0 <= (seconds(answer.rate_headers["x-ratelimit-reset-tokens"]) or 0) <= 61
    assert limiter.rpm_ceiling == (600 if style != "cerebras" else limiter.rpm_ceiling)
    if style != "cerebras":
        assert answer.rate_headers["x-ratelimit-limit-requests"] == "600"
    else:  # its per-day request quota is no per-minute limit
        assert "x-ratelimit-limit-requests" not in answer.rate_headers


def test_a_gateways_request_limit_is_read_where_its_window_is_said() -> None:
    """An API gateway in front of a server that says no limits (Envoy, Kong, the IETF
    draft's forms) was not read: its limit was learned from its 429s alone."""
    ietf = {"RateLimit-Policy": '"default";q=50;w=1', "RateLimit": '"default";r=12;t=0.4'}
    assert openai_names(ietf, NEW_YEAR) == {"x-ratelimit-limit-requests": "3000",
                                             "x-ratelimit-remaining-requests": "12",
                                             "x-ratelimit-reset-requests": "0.400"}  # fmt: skip
    envoy = {
        "X-RateLimit-Limit": "10, 10;w=1, 1000;w=3600",
        "X-RateLimit-Remaining": "7",
        "X-RateLimit-Reset": "1",
    }  # an hour's quota is no rate: the second's is read
    assert openai_names(envoy, NEW_YEAR) == {"x-ratelimit-limit-requests": "600",
                                              "x-ratelimit-remaining-requests": "7",
                                              "x-ratelimit-reset-requests": "1.000"}  # fmt: skip
    kong = {
        "X-RateLimit-Limit-Second": "50",
        "X-RateLimit-Remaining-Second": "40",
        "X-RateLimit-Limit-Minute": "1000",
        "X-RateLimit-Remaining-Minute": "900",
        "RateLimit-Limit": "50",
        "RateLimit-Remaining": "40",
        "RateLimit-Reset": "1",
    }
    assert openai_names(kong, NEW_YEAR) == {"x-ratelimit-limit-requests": "1000",
                                             "x-ratelimit-remaining-requests": "900",
                                             "x-ratelimit-reset-requests": "1.000"}  # fmt: skip
    prefixed = {
        "X-RateLimit-Policy": "20;w=60",
        "X-RateLimit-Limit": "20",
        "X-RateLimit-Remaining": "0",
        "Retry-After": "31",
    }
    assert openai_names(prefixed, NEW_YEAR) == {"x-ratelimit-limit-requests": "20",
                                                 "x-ratelimit-remaining-requests": "0"}  # fmt: skip
    # A reset said as the time itself (seconds or milliseconds since 1970).
    stamped = {"RateLimit-Policy": "60;w=60", "RateLimit-Reset": str(int(NEW_YEAR) + 30)}
    assert openai_names(stamped, NEW_YEAR)["x-ratelimit-reset-requests"] == "30.000"
    stamped["RateLimit-Reset"] = str(int(NEW_YEAR) * 1000 + 1500)
    assert openai_names(stamped, NEW_YEAR)["x-ratelimit-reset-requests"] == "1.500"
    # A limit whose window is not said (a second's? an hour's?) says nothing; a provider's
    # own request headers win over a gateway's.
    assert openai_names({"RateLimit-Limit": "100", "RateLimit-Remaining": "4"}, NEW_YEAR) == {}
    assert openai_names({"X-RateLimit-Limit": "60", "X-RateLimit-Remaining": "59"}) == {}
    both = {
        "x-ratelimit-limit-requests": "500",
        "x-ratelimit-remaining-requests": "3",
        "RateLimit-Policy": "100;w=60",
        "RateLimit-Remaining": "9",
    }
    assert openai_names(both, NEW_YEAR) == {"x-ratelimit-limit-requests": "500",
                                             "x-ratelimit-remaining-requests": "3"}  # fmt: skip


@pytest.mark.parametrize("style", ["envoy", "kong"])
async def test_a_gateways_request_limit_is_learned_through_the_simulator(
    simulator: SimulatorServer, style: str
) -> None:
    limiter, answer = await first_answer(simulator, style)
    assert limiter.informed and limiter.rpm_ceiling == 600
    assert 0 <= float(answer.rate_headers["x-ratelimit-remaining-requests"]) < 600
    assert "x-ratelimit-limit-tokens" not in answer.rate_headers  # a gateway counts no tokens


def test_the_simulator_refuses_a_header_style_it_does_not_speak() -> None:
    from streams.dev.simulator import SimConfig

    with pytest.raises(ValueError, match="header_style"):
        SimConfig().update({"header_style": "gemini"})
