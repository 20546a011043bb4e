"""What a task's calls used (`Spend`) and what that costs (`Prices`): one rule for every
tier — the price table, the cached-prompt price, and the batch price
(`Prices.discount`) for tokens of batch and flex calls."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from streams.contract.lanes import Tier
from streams.settings import Settings

if TYPE_CHECKING:
    from streams.core.batch.parking import Parking
    from streams.llm.client import LLMResponse
    from streams.llm.deployments import Deployment


@dataclass(frozen=True)
class Prices:
    """USD per 1,000 tokens, and the share of it batch and flex calls cost; the
    deployments with prices of their own (`llm.deployments`) by name."""

    prompt_per_1k: float = 0.0
    completion_per_1k: float = 0.0
    discount: float = 0.5  # batch (and flex) price / sync price
    # A prompt token read from the provider's cache (None: no price of its own, the full one)
    cached_prompt_per_1k: float | None = None
    deployments: Mapping[str, Prices] = field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def from_settings(cls, settings: Settings, deployments: Sequence[Deployment] = ()) -> Prices:
        llm = settings.llm
        base = cls(llm.price_per_1k_prompt_usd, llm.price_per_1k_completion_usd,
                   settings.batch_api.price_ratio,
                   llm.price_per_1k_cached_prompt_usd)  # fmt: skip
        own: dict[str, Prices] = {}
        for d in deployments:
            spec = d.spec
            prompt, completion = spec.price_per_1k_prompt_usd, spec.price_per_1k_completion_usd
            cached = spec.price_per_1k_cached_prompt_usd
            own[d.name] = cls(
                base.prompt_per_1k if prompt is None else prompt,
                base.completion_per_1k if completion is None else completion,
                base.discount,
                # A deployment's own input price without a cached one: the cache at it.
                cached if cached is not None or prompt is not None else base.cached_prompt_per_1k,
            )
        return cls(base.prompt_per_1k, base.completion_per_1k, base.discount,
                   base.cached_prompt_per_1k, own)  # fmt: skip

    def of_deployment(self, name: str) -> Prices:
        return self.deployments.get(name, self)

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
        """USD for what one task's calls used, each deployment's tokens at its price."""
        return round(sum(self.split(spend).values()), 8)

    def split(self, spend: Spend) -> dict[str, float]:
        """USD per deployment that answered (tokens no deployment was named for: "")."""
        rest = spend.totals
        out: dict[str, float] = {}
        for name, part in spend.by_deployment.items():
            out[name] = self.of_deployment(name).priced(part)
            rest.take_out(part)
        if rest.prompt or rest.completion or not out:
            out[""] = self.priced(rest)
        return out

    def capped(self, spend: Spend) -> dict[str, float]:
        """What spend caps count, per deployment: the answered calls' cost (`split`) and
        the prompts of calls that got no answer at the prompt price (a server that went
        on with them may bill them: a slow provider must not spend past a cap unseen)."""
        out = self.split(spend)
        for name, tokens in spend.unanswered.items():
            usd = self.of_deployment(name).cost(tokens, 0)
            out[name] = round(out.get(name, 0.0) + usd, 8)
        return out

    def priced(self, tokens: Tokens) -> float:
        return self.cost(tokens.prompt, tokens.completion, tokens.discounted_prompt,
                         tokens.discounted_completion, tokens.cached)  # fmt: skip

    def estimate(self, prompt_tokens: int, completion_tokens: float, tier: Tier) -> float:
        """What asking costs in `tier` (a replay's estimate, a spend cap's hold): at the
        dearest price a deployment may answer it at, so a cap counts in-flight spend high
        rather than low."""
        full = max(p.cost(prompt_tokens, completion_tokens)
                   for p in (self, *self.deployments.values()))  # fmt: skip
        return full if tier is Tier.SYNC else round(full * self.discount, 8)


@dataclass
class Tokens:
    """Tokens of one deployment's answers (the `discounted_*` ones at the batch price)."""

    prompt: int = 0
    completion: int = 0
    cached: int = 0
    discounted_prompt: int = 0
    discounted_completion: int = 0

    def add(self, other: Tokens) -> None:
        self.prompt += other.prompt
        self.completion += other.completion
        self.cached += other.cached
        self.discounted_prompt += other.discounted_prompt
        self.discounted_completion += other.discounted_completion

    def take_out(self, other: Tokens) -> None:
        self.prompt = max(0, self.prompt - other.prompt)
        self.completion = max(0, self.completion - other.completion)
        self.cached = max(0, self.cached - other.cached)
        self.discounted_prompt = max(0, self.discounted_prompt - other.discounted_prompt)
        self.discounted_completion = max(
            0, self.discounted_completion - other.discounted_completion
        )


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
    # The tokens above, by the deployment that answered them (priced at its price).
    by_deployment: dict[str, Tokens] = field(default_factory=dict)
    # Prompt tokens of calls sent that got no answer (`resilience.guarded.UNANSWERED`), by
    # the deployment they went to: apart from the tokens above (no usage was reported).
    unanswered: dict[str, int] = field(default_factory=dict)

    def took(
        self, response: LLMResponse, *, repair: bool = False, discounted: bool = False
    ) -> None:
        """Take in one call's answer (`repair`: the call asked to repair an answer;
        `discounted`: it was answered at the batch price — a batch, a confirmed flex)."""
        self.last_prompt_tokens = response.prompt_tokens
        self.calls.append(response.content)
        if repair:
            self.repair_tokens += response.prompt_tokens + response.completion_tokens
        self.used(Tokens(response.prompt_tokens, response.completion_tokens,
                         response.cached_prompt_tokens,
                         response.prompt_tokens if discounted else 0,
                         response.completion_tokens if discounted else 0),
                  response.model, response.deployment)  # fmt: skip

    def used(self, tokens: Tokens, model: str, deployment: str = "") -> None:
        """Take in tokens answered by `deployment` (a call's, a pack's share)."""
        self._count(tokens)
        self.model = model or self.model
        if deployment:
            self.by_deployment.setdefault(deployment, Tokens()).add(tokens)

    def went_unanswered(self, deployment: str, prompt_tokens: int) -> None:
        """A call with a prompt of `prompt_tokens` went to `deployment` and got no answer."""
        self.unanswered[deployment] = self.unanswered.get(deployment, 0) + prompt_tokens

    @property
    def unanswered_tokens(self) -> int:
        return sum(self.unanswered.values())

    @property
    def totals(self) -> Tokens:
        return Tokens(self.prompt_tokens, self.completion_tokens, self.cached_prompt,
                      self.discounted_prompt, self.discounted_completion)  # fmt: skip

    def _count(self, tokens: Tokens) -> None:
        self.prompt_tokens += tokens.prompt
        self.completion_tokens += tokens.completion
        self.cached_prompt += tokens.cached
        self.discounted_prompt += tokens.discounted_prompt
        self.discounted_completion += tokens.discounted_completion

    def add(self, other: Spend) -> None:
        """Take in a part's spend (a chunk's, a pack's share)."""
        self._count(other.totals)
        self.rejected += other.rejected
        for name, part in other.by_deployment.items():
            self.by_deployment.setdefault(name, Tokens()).add(part)
        for name, tokens in other.unanswered.items():
            self.went_unanswered(name, tokens)
        self.model = other.model or self.model
        self.last_prompt_tokens = max(self.last_prompt_tokens, other.last_prompt_tokens)


__all__ = ["Prices", "Spend", "Tokens"]
