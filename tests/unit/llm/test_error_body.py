"""Which limit a 429 hit, in each provider's words (as their servers send them)."""

from __future__ import annotations

from typing import Any

import pytest

from streams.dev.simulator import SimulatorServer
from streams.errors import BadRequest, LimitHit, NotServed, RateLimited
from streams.llm.client import error_for_status
from streams.llm.error_body import limit_hit, retry_delay
from streams.llm.openai_client import OpenAIClient
from tests.fakes import SIM_REQUEST

GROQ_TPM = {
    "error": {
        "message": "Rate limit reached for model `llama-3.3-70b-versatile` in organization "
        "`org_01` service tier `on_demand` on tokens per minute (TPM): Limit 6000, Used 3513, "
        "Requested 3166. Please try again in 6.780999999s. Visit https://console.groq.com/docs/"
        "rate-limits for more information.",
        "type": "tokens",
        "code": "rate_limit_exceeded",
    }
}
OPENAI_RPM = {
    "error": {
        "message": "Rate limit reached for gpt-4o in organization org-x on requests per min "
        "(RPM): Limit 3, Used 3, Requested 1. Please try again in 20s.",
        "type": "requests",
        "param": None,
        "code": "rate_limit_exceeded",
    }
}
OPENAI_TOO_LARGE = {
    "error": {
        "message": "Request too large for gpt-4o in organization org-V on tokens per min (TPM): "
        "Limit 30000, Requested 30601. The input or output tokens must be reduced in order to "
        "run successfully.",
        "type": "tokens",
        "param": None,
        "code": "rate_limit_exceeded",
    }
}
GROQ_RPD = {
    "error": {
        "message": "Rate limit reached for model `llama-3.1-8b-instant` in organization `org_01` "
        "on requests per day (RPD): Limit 14400, Used 14400, Requested 1. Please try again in "
        "6s.",
        "type": "requests",
        "code": "rate_limit_exceeded",
    }
}
AZURE_TOKENS = {
    "error": {
        "code": "429",
        "message": "Requests to the ChatCompletions_Create Operation under Azure OpenAI API version "
        "2024-05-01-preview have exceeded token rate limit of your current OpenAI S0 pricing "
        "tier. Please retry after 6 seconds.",
    }
}
AZURE_CALLS = {
    "error": {
        "code": "429",
        "message": "Your requests to gpt-5.1 for gpt-5.1 in East US 2 have exceeded the call rate limit "
        "for your current AIServices S0 pricing tier. Please retry after 60 seconds.",
    }
}
CEREBRAS_RPM = {
    "message": "Requests per minute limit exceeded - too many requests sent.",
    "type": "too_many_requests_error",
    "param": "quota",
    "code": "request_quota_exceeded",
}
CEREBRAS_TPD = {
    "message": "Tokens per day limit exceeded - too many tokens processed.",
    "type": "too_many_requests_error",
    "param": "quota",
    "code": "token_quota_exceeded",
}
ANTHROPIC_RPM = {
    "type": "error",
    "error": {
        "type": "rate_limit_error",
        "message": "This request would exceed the rate limit for your organization (4b2a) of 50 requests "
        "per minute. For details, refer to the rate limits documentation.",
    },
}
ANTHROPIC_ITPM = {
    "type": "error",
    "error": {
        "type": "rate_limit_error",
        "message": "This request would exceed your organization's rate limit of 40,000 input tokens per "
        "minute.",
    },
}
GEMINI_RPM = [
    {
        "error": {
            "code": 429,
            "message": "You exceeded your current quota.",
            "status": "RESOURCE_EXHAUSTED",
            "details": [
                {
                    "@type": "type.googleapis.com/google.rpc.QuotaFailure",
                    "violations": [
                        {
                            "quotaMetric": "generativelanguage.googleapis.com/"
                            "generate_content_free_tier_requests",
                            "quotaId": "GenerateRequestsPerMinutePerProjectPerModel-FreeTier",
                            "quotaValue": "10",
                        }
                    ],
                },
                {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "37s"},
            ],
        }
    }
]
GEMINI_DAY_TOKENS = [{"error": {"code": 429, "message": "You exceeded your current quota.",
    "details": [{"@type": "type.googleapis.com/google.rpc.QuotaFailure", "violations": [{
        "quotaMetric": "generativelanguage.googleapis.com/generate_content_input_token_count",
        "quotaId": "GenerateContentInputTokensPerModelPerDay-FreeTier",
        "quotaValue": "1000000"}]}]}}]  # fmt: skip

# OpenRouter's free models (as users meet them): the limit's own headers in the body.
OPENROUTER_DAY = {"error": {"message": "Rate limit exceeded: free-models-per-day. Add 10 "
    "credits to unlock 1000 free model requests per day", "code": 429, "metadata": {
        "headers": {"X-RateLimit-Limit": "50", "X-RateLimit-Remaining": "0",
                    "X-RateLimit-Reset": "1767312000000"}}}}  # fmt: skip
OPENROUTER_MIN = {"error": {"message": "Rate limit exceeded: free-models-per-min.", "code": 429}}


@pytest.mark.parametrize(
    ("body", "hit"),
    [
        (GROQ_TPM, LimitHit("tokens", 60, 6000)),
        (OPENAI_RPM, LimitHit("requests", 60, 3)),
        (OPENAI_TOO_LARGE, LimitHit("tokens", 60, 30000, 30601)),
        (GROQ_RPD, LimitHit("requests", 86400, 14400)),
        (AZURE_TOKENS, LimitHit("tokens", 60)),
        (AZURE_CALLS, LimitHit("requests", 60)),
        (CEREBRAS_RPM, LimitHit("requests", 60)),
        (CEREBRAS_TPD, LimitHit("tokens", 86400)),
        (ANTHROPIC_RPM, LimitHit("requests", 60, 50)),
        (ANTHROPIC_ITPM, LimitHit("tokens", 60, partial=True)),
        (GEMINI_RPM, LimitHit("requests", 60, 10)),
        (GEMINI_DAY_TOKENS, LimitHit("tokens", 86400, partial=True)),
        (OPENROUTER_DAY, LimitHit("requests", 86400, 50)),
        (OPENROUTER_MIN, LimitHit("requests", 60)),
        ({"error": {"message": "Too Many Requests"}}, None),
        ({"error": {"message": "slow down", "type": "tokens"}}, LimitHit("tokens")),
        ("<html>429</html>", None),
        (None, None),
    ],
    ids=["groq-tpm", "openai-rpm", "openai-too-large", "groq-rpd", "azure-tokens",
         "azure-calls", "cerebras-rpm", "cerebras-tpd", "anthropic-rpm", "anthropic-itpm",
         "gemini-rpm", "gemini-day-tokens", "openrouter-free-day", "openrouter-free-min",
         "silent", "type-only", "html", "none"],
)  # fmt: skip
def test_a_429s_body_says_which_limit_it_hit(body: Any, hit: LimitHit | None) -> None:
    found = limit_hit(body)
    if hit is not None and hit.requested is None and found is not None:
        found = LimitHit(found.kind, found.per_s, found.limit, None, found.partial)
    assert found == hit


def test_openrouters_free_model_quota_says_when_it_is_back_in_its_body() -> None:
    """OpenRouter's 429 for its free models' quota says nothing a client read: no figure
    in words known here, its headers in the body. Every task retried into it until its
    attempts ran out; a day's quota is now a day's quota (the tasks wait, paused at most
    10 minutes at a time), its reset the wait."""
    new_year = 1767225600.0  # 2026-01-01T00:00:00Z; the reset a day later, in milliseconds
    hit = limit_hit(OPENROUTER_DAY)
    assert hit is not None and hit.quota
    assert retry_delay(OPENROUTER_DAY, new_year) == 86400.0
    assert retry_delay(OPENROUTER_MIN, new_year) is None


def test_the_figures_requested_and_quotas_are_read() -> None:
    tpm = limit_hit(GROQ_TPM)
    assert tpm is not None and tpm.requested == 3166 and not tpm.quota and not tpm.never_fits
    rpd = limit_hit(GROQ_RPD)
    assert rpd is not None and rpd.quota
    too_large = limit_hit(OPENAI_TOO_LARGE)
    assert too_large is not None and too_large.never_fits


def test_a_429_carries_its_hit_and_a_request_over_the_limit_is_a_bad_request() -> None:
    """OpenAI answers a request larger than the token limit itself with a 429 (Groq with a
    413): asked again it never fits; it was retried until its deadline, pausing the
    endpoint's every call at each refusal."""
    limited = error_for_status(429, "rate_limit_exceeded", "HTTP 429", body=GROQ_TPM)
    assert isinstance(limited, RateLimited) and limited.hit == limit_hit(GROQ_TPM)
    for status in (429, 413):
        refused = error_for_status(status, "rate_limit_exceeded", "HTTP", body=OPENAI_TOO_LARGE)
        assert isinstance(refused, BadRequest) and refused.code == "request_over_limit"
        assert "30601" in str(refused) and "30000" in str(refused)


@pytest.mark.parametrize("style", ["openai", "anthropic", "cerebras", "azure", "groq", "envoy",
                                   "kong", "mistral", None])  # fmt: skip
async def test_the_simulator_words_its_429s_as_each_provider(
    simulator: SimulatorServer, style: str | None
) -> None:
    """The simulator's 429s in each provider's words (None: a provider that says nothing
    of its limits; a gateway's words name no limit: its headers do), read back as a client
    reads them."""
    simulator.sim.config.update({"rpm": 60, "tpm": 0, "header_style": style or "openai",
                                 "rate_headers": style is not None})  # fmt: skip
    client = OpenAIClient(base_url=simulator.base_url, api_key="k", connect_timeout_s=1,
                          read_timeout_s=2)  # fmt: skip
    try:
        await client.complete(SIM_REQUEST)
        with pytest.raises(RateLimited) as refused:
            await client.complete(SIM_REQUEST)
    finally:
        await client.close()
    hit = refused.value.hit
    if style in (None, "envoy", "kong", "mistral"):
        assert hit is None
    else:
        assert hit is not None and hit.kind == "requests" and hit.per_s == 60
        said = style in ("openai", "groq", "anthropic")
        assert hit.limit == (60 if said else None)


# LiteLLM's proxy for a model name its config does not route (its words, as users meet
# them: BerriAI/litellm#2398, #9663), and DeepSeek's: 400s, where OpenAI says 404.
LITELLM_NO_ROUTE = ("400: {'error': '/chat/completions: Invalid model name passed in "
                    "model=gpt-5. Call `/v1/models` to view available models for your key.'}")  # fmt: skip


def test_a_model_not_served_said_with_a_400_is_not_served() -> None:
    for status, code, message in ((400, "400", LITELLM_NO_ROUTE),
                                  (400, "invalid_request_error", "Model Not Exist"),
                                  (400, "model_not_found", "The model `x` does not exist"),
                                  (404, None, "Not Found")):  # fmt: skip
        assert isinstance(error_for_status(status, code, f"HTTP {status}: {message}"), NotServed)
    plain = error_for_status(400, "invalid_request_error", "HTTP 400: 'temperature' is too high")
    assert type(plain) is BadRequest
    assert not isinstance(error_for_status(400, None, "HTTP 400: the model said no"), NotServed)
