"""The numbers a provider's headers say: limits, what is left, when to come back."""

from __future__ import annotations

import pytest

from streams.dev.simulator import SimulatorServer
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
    assert openai_names(openai, NEW_YEAR) == {k.lower(): v for k, v in openai.items()}
    # OpenAI's own name wins; a reset that is no time (or in no zone) is left out.
    mixed = {"x-ratelimit-limit-requests": "500", "anthropic-ratelimit-requests-limit": "9",
             "anthropic-ratelimit-requests-reset": "soon",
             "anthropic-ratelimit-tokens-reset": "2026-01-01T00:00:09"}  # fmt: skip
    assert openai_names(mixed, NEW_YEAR) == {"x-ratelimit-limit-requests": "500"}


@pytest.mark.parametrize("style", ["openai", "anthropic", "cerebras"])
async def test_a_limit_said_in_any_providers_headers_is_learned(
    simulator: SimulatorServer, style: str
) -> None:
    """Through the simulator speaking each provider's headers, the client and a limiter
    told no limit: the first answer teaches the token limit, as OpenAI's headers do (and
    the request limit where the provider says one per minute)."""
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
    assert limiter.informed and limiter.tpm_ceiling == 90_000
    assert float(answer.rate_headers["x-ratelimit-remaining-tokens"]) < 90_000
    assert 0 <= (seconds(answer.rate_headers["x-ratelimit-reset-tokens"]) or 0) <= 61
    assert limiter.rpm_ceiling == (600 if style != "cerebras" else limiter.rpm_ceiling)
    if style != "cerebras":
        assert answer.rate_headers["x-ratelimit-limit-requests"] == "600"
    else:  # its per-day request quota is no per-minute limit
        assert "x-ratelimit-limit-requests" not in answer.rate_headers


def test_the_simulator_refuses_a_header_style_it_does_not_speak() -> None:
    from streams.dev.simulator import SimConfig

    with pytest.raises(ValueError, match="header_style"):
        SimConfig().update({"header_style": "gemini"})
