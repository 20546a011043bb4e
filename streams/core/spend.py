"""What a task's calls used (`Spend`) and what that costs (`Prices`): one rule for every
tier — the price table, the cached-prompt price, and the batch price
(`Prices.discount`) for tokens of batch and flex calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from streams.contract.lanes import Tier
from streams.settings import Settings

if TYPE_CHECKING:
    from streams.core.batch.parking import Parking
    from streams.llm.client import LLMResponse


@dataclass(frozen=True)
class Prices:
    """USD per 1,000 tokens, and the share of it batch and flex calls cost."""

    prompt_per_1k: float = 0.0
    completion_per_1k: float = 0.0
    discount: float = 0.5  # batch (and flex) price / sync price
    # A prompt token read from the provider's cache (None: no price of its own, the full one)
    cached_prompt_per_1k: float | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> Prices:
        llm = settings.llm
        return cls(llm.price_per_1k_prompt_usd, llm.price_per_1k_completion_usd,
                   settings.batch_api.price_ratio,
                   llm.price_per_1k_cached_prompt_usd)  # fmt: skip

    def cost(
        self,
        prompt_tokens: int,
        completion_tokens: float,
        discounted_prompt: int = 0,
        discounted_completion: int = 0,
        cached_prompt: int = 0,
    ) -> float:
        """USD for the tokens; the `cached_prompt` ones (among the prompt's) at the cached
        price when there is one; the `discounted_*` ones at the batch price."""
        per_prompt = self.prompt_per_1k
        if cached_prompt and prompt_tokens and self.cached_prompt_per_1k is not None:
            cached = min(cached_prompt, prompt_tokens)
            per_prompt = (
                (prompt_tokens - cached) * self.prompt_per_1k + cached * self.cached_prompt_per_1k
            ) / prompt_tokens  # the discounted ones: as cached as the rest, on average
        full = prompt_tokens * per_prompt + completion_tokens * self.completion_per_1k
        off = discounted_prompt * per_prompt + discounted_completion * self.completion_per_1k
        return round((full - off * (1 - self.discount)) / 1000, 8)

    def of(self, spend: Spend) -> float:
        """USD for what one task's calls used."""
        return self.cost(spend.prompt_tokens, spend.completion_tokens, spend.discounted_prompt,
                         spend.discounted_completion, spend.cached_prompt)  # fmt: skip

    def estimate(self, prompt_tokens: int, completion_tokens: float, tier: Tier) -> float:
        """What asking costs in `tier` (a replay's estimate)."""
        if tier is Tier.SYNC:
            return self.cost(prompt_tokens, completion_tokens)
        return round(self.cost(prompt_tokens, completion_tokens) * self.discount, 8)


@dataclass
class Spend:
    """What one task's calls used, and how they were made and priced."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    model: str = ""
    calls: list[str] = field(default_factory=list)  # the answers' text, for a repair
    last_prompt_tokens: int = 0
    repair_tokens: int = 0
    rejected: int = 0  # answers the output checks rejected
    tier: Tier = Tier.SYNC
    route: tuple[int, str] | None = None  # batch tier: (partition, custom_id)
    parking: Parking | None = None  # batch tier, run by the edge: the job may park
    discounted_prompt: int = 0  # tokens billed at the batch/flex price
    discounted_completion: int = 0
    cached_prompt: int = 0  # prompt tokens the provider read from its cache

    def took(self, response: LLMResponse, *, repair: bool = False) -> None:
        """Take in one call's answer (`repair`: the call asked to repair an answer)."""
        self.last_prompt_tokens = response.prompt_tokens
        self.prompt_tokens += response.prompt_tokens
        self.cached_prompt += response.cached_prompt_tokens
        self.completion_tokens += response.completion_tokens
        self.model = response.model
        self.calls.append(response.content)
        if repair:
            self.repair_tokens += response.prompt_tokens + response.completion_tokens

    def add(self, other: Spend) -> None:
        """Take in a part's spend (a chunk's, a pack's share)."""
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.discounted_prompt += other.discounted_prompt
        self.discounted_completion += other.discounted_completion
        self.cached_prompt += other.cached_prompt
        self.rejected += other.rejected
        self.model = other.model or self.model
        self.last_prompt_tokens = max(self.last_prompt_tokens, other.last_prompt_tokens)


__all__ = ["Prices", "Spend"]
