"""Routing by headroom: which deployment of a model takes a call.

Each deployment has its own breaker, rate limiter and concurrency limit (its guarded
client). A call goes to the one that can take it soonest: a breaker that is open (or
whose probe slots are all out) leaves a deployment out while another can take the call;
among the rest, the least wait its limiter and its concurrency limit foresee — so a
burst of 429s (the limiter paused) or a deployment at its limit moves calls to the
others at once, and they come back when it has room again. While several have room
now, calls are spread by their weights, except that a prompt whose prefix is long
enough to be cached and went to a deployment before — its first message; a session's
turns, their first turn too — goes there again (the provider's prompt cache) when that
costs no wait. A deployment at its spend cap (`core.budget`) is behind every other
until its next window, like a breaker that admits no call.

Written here: LiteLLM's router picks a deployment by usage it counts in Redis; ours
reads the limiters the worker already keeps (limits learned from the provider's
headers, or from its pace for a server that sends none), which no library has.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from streams.contract.lanes import Lane
from streams.resilience.guarded import GuardedClient

READY_S = 0.005  # a deployment this close to taking a call has room now
NEAR = 0.1  # none has room: those within a tenth of the soonest's wait are as soon
AFFINITY_SLACK_S = 0.05  # the most wait a prompt cache's deployment may add
# A first message this long may be cached by the provider (OpenAI caches prompts from
# 1,024 tokens, ~4 characters each): shorter ones are spread by weight like the rest.
AFFINITY_MIN_CHARS = 4000
BLOCKED_S = 1_000.0  # a breaker that admits no call: behind every one that does
AFFINITY_KEYS = 4096  # prompt prefixes remembered, least recently used out first


def _uncapped() -> float:
    return 0.0


@dataclass(frozen=True)
class Member:
    name: str
    client: GuardedClient
    weight: float = 1.0
    # Seconds until the deployment is under its spend caps again (0: it is).
    capped: Callable[[], float] = _uncapped

    def wait(self) -> float:
        """Seconds until it could take a call (`wait_of`), behind every deployment that
        can while it is at its spend cap."""
        capped = self.capped()
        return BLOCKED_S + capped if capped > 0 else wait_of(self.client)


class Route:
    """The deployments of one model, and the choice among them for each call."""

    def __init__(self, model: str, members: list[Member], *, seed: int | None = None) -> None:
        if not members:
            raise ValueError(f"no deployment serves {model}")
        self.model = model
        self.members = members
        self._rng = random.Random(seed)
        self._served: OrderedDict[bytes, str] = OrderedDict()  # prefix -> deployment

    @classmethod
    def single(cls, client: GuardedClient) -> Route:
        return cls("", [Member(client.deployment, client)])

    def capped_for(self) -> float:
        """Seconds until some deployment of the model is under its spend caps again (0:
        one is, or has none)."""
        return min(m.capped() for m in self.members)

    @property
    def primary(self) -> GuardedClient:
        """The first deployment: its window is the one prompts are fitted to."""
        return self.members[0].client

    def pick(self, lane: Lane = Lane.LIVE, prefix: str | None = None) -> GuardedClient:
        """The deployment that takes the next call (`prefix`: what the prompt shares with
        earlier calls a provider may have cached, `prefix_of`)."""
        if len(self.members) == 1:
            return self.members[0].client
        waits = [(m.wait(), m) for m in self.members]
        key = _key(prefix) if prefix else None
        best = min(w for w, _ in waits)
        if key is not None and (name := self._served.get(key)) is not None:
            for wait, member in waits:
                if member.name == name and wait <= best + AFFINITY_SLACK_S:
                    self._served.move_to_end(key)
                    return member.client
        # Room now, or (none has) the soonest: the few about as soon, spread by weight.
        near = [m for w, m in waits if w <= max(READY_S, best * (1 + NEAR))]
        chosen = self._rng.choices(near, weights=[m.weight for m in near])[0]
        if key is not None:
            self._served[key] = chosen.name
            self._served.move_to_end(key)
            if len(self._served) > AFFINITY_KEYS:
                self._served.popitem(last=False)
        return chosen.client


def wait_of(client: GuardedClient) -> float:
    """Seconds until `client` could take a call: its breaker's reopening when it lets no
    call through, or its cooling off after failures in a row (behind every deployment
    that admits calls), else what its limiter and its concurrency limit foresee."""
    breaker = client.breaker
    blocked = max(breaker.blocked_for(), breaker.cooling_for())
    if blocked > 0:
        return BLOCKED_S + blocked
    return max(client.limiter.ready_in(), client.concurrency.ready_in())


def prefix_of(messages: list[dict[str, str]]) -> str | None:
    """What a prompt shares with earlier calls that a provider may have cached: its first
    message, and for a turn with earlier turns in it (a session) the first of those too —
    the same for all of a session's turns. None when what it shares is too short for a
    provider to cache."""
    if not messages:
        return None
    shared = messages[:-1] if len(messages) > 2 else messages[:1]
    if sum(len(m["content"]) for m in shared) < AFFINITY_MIN_CHARS:
        return None
    return "\x00".join(m["content"] for m in messages[: 2 if len(messages) > 2 else 1])


def _key(prefix: str) -> bytes:
    return hashlib.blake2b(prefix.encode(), digest_size=12).digest()


__all__ = ["Member", "Route", "prefix_of", "wait_of"]
