"""What a task's record says of its answer, and what a prompt version's records add up
to: the rules `llm-streams status` (from a worker's counters), the per-version metrics
and `ab report` (from the topics) share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# A task's content verdict, for the per-version evaluation (metrics, `ab report`): its
# first answer passed the output checks, or passed after a repair, or it was answered from
# an earlier answer (no call), or every answer was rejected, or it failed otherwise.
VERDICTS = ("pass", "repaired", "cached", "rejected", "failed")


def verdict(kind: str, category: str | None, rejected: int, cached: bool) -> str:
    """The content verdict of an outcome (`VERDICTS`), from what its record says."""
    if kind == "result":
        return "cached" if cached else ("repaired" if rejected else "pass")
    return "rejected" if category == "invalid_output" else "failed"


@dataclass
class Evaluation:
    """What a prompt version's finished tasks add up to: the figures `llm-streams status`
    shows from a worker's counters and `ab report` from the topics, defined once."""

    verdicts: dict[str, int] = field(default_factory=dict)  # tasks by `verdict`
    cost_usd: float = 0.0
    tokens: int = 0
    reviews: int = 0

    def add(self, verdict_: str, *, cost_usd: float = 0.0, tokens: int = 0,
            reviewed: bool = False) -> None:  # fmt: skip
        self.verdicts[verdict_] = self.verdicts.get(verdict_, 0) + 1
        self.cost_usd += cost_usd
        self.tokens += tokens
        self.reviews += reviewed

    def n(self, *names: str) -> int:
        return sum(self.verdicts.get(name, 0) for name in names)

    @property
    def tasks(self) -> int:
        return self.n(*VERDICTS)

    @property
    def judged(self) -> int:
        """Tasks whose answers met the output checks: fresh answers, kept or not."""
        return self.n("pass", "repaired", "rejected")

    @property
    def accepted(self) -> int:
        return self.n("pass", "repaired", "cached")

    @property
    def pass_rate(self) -> float | None:
        """Content pass rate: of the judged tasks, those whose first answer passed."""
        return self.n("pass") / self.judged if self.judged else None

    @property
    def repair_rate(self) -> float | None:
        return self.n("repaired") / self.judged if self.judged else None

    @property
    def dead_letter_rate(self) -> float | None:
        return self.n("rejected", "failed") / self.tasks if self.tasks else None

    @property
    def cost_per_accepted(self) -> float | None:
        """Every cent the version spent (dead letters' too) per task it answered."""
        return self.cost_usd / self.accepted if self.accepted else None

    @property
    def tokens_per_accepted(self) -> float | None:
        return self.tokens / self.accepted if self.accepted else None

    @property
    def review_share(self) -> float | None:
        return self.reviews / self.accepted if self.accepted else None


@dataclass(frozen=True)
class PromotionGuard:
    """What `ab promote` asks of a version before it takes traffic: enough judged tasks,
    a pass rate not significantly worse than a rival's, and a cost per answered task
    not significantly more than `1 + max_cost_increase` times a rival's (95% intervals;
    `inf`: cost not checked). Checked by `ops.ab.guard`, recorded with the decision."""

    min_judged: int = 30
    max_cost_increase: float = 0.25

    def as_record(self) -> dict[str, Any]:
        return {"min_judged": self.min_judged,
                "max_cost_increase": None if math.isinf(self.max_cost_increase)
                else self.max_cost_increase}  # fmt: skip


__all__ = ["VERDICTS", "Evaluation", "PromotionGuard", "verdict"]
