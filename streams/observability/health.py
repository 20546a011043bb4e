"""The worker's two probes, for Kubernetes, compose and load balancers.

`/healthz` (alive) answers while the worker's loop does: it never looks at Kafka or the
LLM, so an outage of either does not get a worker restarted (which would only add a
rebalance to the outage). `/readyz` (ready) says whether the worker has taken its part of
the group's work: a rebalance has ended, every partition it owns has its task store
loaded (until then its records wait), no endpoint's breaker is open (its calls are
being refused: the endpoint is away or failing) — a deployment's counts only when every
other deployment of its model is open too —, and the task store's disk takes its writes
(past `store_unflushed_mb` refused, records wait). A worker owning no partition (more
workers than partitions) is ready: it stands by.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from streams.observability.metrics import BREAKER_STATES, Metrics

_OPEN = BREAKER_STATES["open"]


@dataclass(frozen=True)
class Readiness:
    joined: bool  # a rebalance gave this worker its partitions (perhaps none)
    partitions: tuple[int, ...]  # owned
    loading: tuple[int, ...]  # owned, their store not loaded yet
    open_breakers: tuple[str, ...]  # endpoints whose calls are refused
    standby: tuple[int, ...] = ()  # partitions followed for another worker (not owned)
    disk_refusing: bool = False  # the task store's disk refuses writes: records wait

    @property
    def ready(self) -> bool:
        return (
            self.joined and not self.loading and not self.open_breakers and not self.disk_refusing
        )

    def reasons(self) -> list[str]:
        """Why the worker is not ready, one line each (none when it is)."""
        found = []
        if not self.joined:
            found.append("not yet given its partitions by the group (rebalance under way)")
        if self.loading:
            found.append(f"loading the task store of partition(s) {list(self.loading)}")
        for endpoint in self.open_breakers:
            found.append(f"breaker open for {endpoint}: its calls fail or it is away")
        if self.disk_refusing:
            found.append("the task store's disk refuses its writes (full?): records wait "
                         "until it takes them")  # fmt: skip
        return found

    def as_json(self) -> dict[str, Any]:
        return {"ready": self.ready, "reasons": self.reasons(), "joined": self.joined,
                "partitions": list(self.partitions), "loading": list(self.loading),
                "open_breakers": list(self.open_breakers),
                "standby": list(self.standby), "disk_refusing": self.disk_refusing}  # fmt: skip


def open_breakers(metrics: Metrics) -> tuple[str, ...]:
    """The endpoints whose breaker is open, as the worker's metrics say — but not a
    deployment whose model another deployment still serves (its calls go there)."""
    states = {
        sample.labels["endpoint"]: sample.value
        for family in metrics.breaker_state.collect()
        for sample in family.samples
    }
    serves = metrics.deployment_models
    serving = {serves[name] for name, state in states.items()
               if name in serves and state != _OPEN}  # fmt: skip
    return tuple(sorted(
        name for name, state in states.items()
        if state == _OPEN and serves.get(name) not in serving
    ))  # fmt: skip
