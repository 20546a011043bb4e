"""What an answer says it used: prompt tokens read from the provider's cache, in each
provider's words, and their price."""

from __future__ import annotations

import orjson
import pytest

from streams.contract.lanes import Tier
from streams.core.spend import Prices, Spend
from streams.llm.client import parse_completion


def _body(usage: dict[str, object]) -> bytes:
    return orjson.dumps({"model": "m", "usage": usage, "choices": [
        {"message": {"content": "{}"}, "finish_reason": "stop"}]})  # fmt: skip


@pytest.mark.parametrize(
    ("usage", "cached"),
    [
        ({"prompt_tokens": 2000, "completion_tokens": 5,
          "prompt_tokens_details": {"cached_tokens": 1536}}, 1536),  # OpenAI, Azure, vLLM
        ({"prompt_tokens": 2000, "completion_tokens": 5,
          "prompt_cache_hit_tokens": 1200, "prompt_cache_miss_tokens": 800}, 1200),  # DeepSeek
        ({"prompt_tokens": 2000, "completion_tokens": 5,
          "prompt_tokens_details": {"cached_tokens": None}}, 0),
        ({"prompt_tokens": 10, "completion_tokens": 5,
          "prompt_tokens_details": {"cached_tokens": 99}}, 10),  # never more than the prompt
        ({"prompt_tokens": 10, "completion_tokens": 5,
          "prompt_tokens_details": {"cached_tokens": "many"}}, 0),
        ({"prompt_tokens": 10, "completion_tokens": 5}, 0),  # unsaid (llama.cpp, most)
    ],
)  # fmt: skip
def test_cached_prompt_tokens_in_each_providers_words(
    usage: dict[str, object], cached: int
) -> None:
    assert parse_completion(_body(usage), "m").cached_prompt_tokens == cached


def test_cached_prompt_tokens_cost_their_price_only_when_one_is_set() -> None:
    spend = Spend(prompt_tokens=2000, completion_tokens=100, cached_prompt=1500)
    full = Prices(prompt_per_1k=1.0, completion_per_1k=2.0)
    assert full.of(spend) == pytest.approx(2.0 + 0.2)  # no cached price: the input price
    cached = Prices(prompt_per_1k=1.0, completion_per_1k=2.0, cached_prompt_per_1k=0.1)
    assert cached.of(spend) == pytest.approx(0.5 + 0.15 + 0.2)
    # At the batch price too: the discounted tokens as cached as the rest, on average.
    batch = Spend(prompt_tokens=2000, completion_tokens=100, cached_prompt=1500,
                  discounted_prompt=2000, discounted_completion=100, tier=Tier.BATCH)  # fmt: skip
    assert cached.of(batch) == pytest.approx((0.5 + 0.15 + 0.2) * 0.5)
