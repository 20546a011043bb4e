"""Spend caps that hold: what a pipeline may spend per clock hour and per UTC day, for
all its lanes together and for each lane apart (`pipelines.specs.BudgetSpec`).

Before a task's calls, `Budgets.hold` counts the window's spend so far plus what the
tasks in flight may cost (their estimate, until each ends and its real cost replaces
it). A task that would pass a cap waits — before its deadline starts, its record
unacknowledged, nothing dead-lettered — and goes on at the next window, when a task in
flight turns out cheaper than its estimate, or when this worker's share grows. The
lane's slots fill with waiting tasks, so the lane stops taking records: backpressure,
not loss. A task alone under a cap always goes, so spend stops within one task's
estimate of the cap.

Several workers share a cap without a shared store: each holds the part of it its
partitions are due (`resilience.limiter.GroupShare`, as the limiters claim theirs).

A deployment's caps (`llm.deployments`: `usd_per_hour`, `usd_per_day`) count what every
pipeline's calls to it cost, booked to the task's partition when the task ends, and
saved like a pipeline's (under `deployment:<name>`). At its cap a deployment takes no
call while another of its model's has room (`resilience.router`); when all are at
theirs, a task of the model waits before its deadline starts, as at a pipeline's cap.
What the model's tasks in flight may cost counts against what its deployments have
left (the model stops within a task's cost of their caps); one deployment may pass its
own by the calls in flight to it when it reaches it while others have room.

Written here: budget features of LLM gateways (LiteLLM's `max_budget`) count spend in a
shared database after each call and refuse the next one; a cap kept before the call,
on estimates, without losing the record that waits, is the few lines below.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from streams.contract.lanes import Lane
from streams.observability.metrics import Metrics
from streams.pipelines.specs import BudgetSpec, Caps
from streams.resilience.clock import Clock, WallClock
from streams.resilience.limiter import GroupShare

log = logging.getLogger(__name__)
_T = TypeVar("_T")

WINDOWS = {"hour": 3600.0, "day": 86400.0}  # clock hours and UTC days since the epoch
ALL = "all"  # the scope of a pipeline's caps over every lane
DEPLOYMENT = "deployment:"  # a deployment's caps' name (no pipeline's name has a colon)


class Withdrawn(Exception):
    """A task waiting at a cap whose partition this worker no longer owns: its new owner
    runs it."""


@dataclass
class _Account:
    """One cap's window: what was spent in it, per task partition (the spend moves with
    its partition), and what tasks in flight may still cost."""

    key: tuple[str, str, str]  # pipeline, scope, window
    cap: float
    length: float
    window: int = -1
    spent: dict[int, float] = field(default_factory=dict)
    in_flight: float = 0.0
    said: bool = False  # the pause was logged in this window


@dataclass(frozen=True)
class SpendMark:
    """A partition's spend in a cap's window, as saved and read back (`store.budgets`): a
    restarted worker, or a partition's next owner, goes on from it."""

    pipeline: str
    scope: str  # all | live | replay
    window: str  # hour | day
    partition: int
    index: int  # which hour or day since the epoch
    spent_usd: float

    @property
    def key(self) -> str:
        return f"{self.pipeline}/{self.scope}/{self.window}/{self.partition}"

    @classmethod
    def read(cls, saved: Any) -> SpendMark:
        """A mark as saved (its fields as a JSON object): the fields this version knows,
        each of its type — one a newer version added is ignored, not a reason to lose the
        spend. Raises ValueError for a record that is not one."""
        if not isinstance(saved, dict):
            raise ValueError(f"not an object: {type(saved).__name__}")
        spent = saved.get("spent_usd")
        if (isinstance(spent, bool) or not isinstance(spent, int | float)
                or not 0 <= spent < math.inf):  # fmt: skip  # NaN is not either
            raise ValueError(f"spent_usd is no amount: {spent!r:.100}")
        return cls(_field(saved, "pipeline", str), _field(saved, "scope", str),
                   _field(saved, "window", str), _field(saved, "partition", int),
                   _field(saved, "index", int), float(spent))  # fmt: skip


def _field(saved: dict[str, Any], name: str, kind: type[_T]) -> _T:
    """A saved record's field of type `kind` (a bool is no int); ValueError otherwise."""
    value = saved.get(name)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"{name} is no {kind.__name__}: {value!r:.100}")
    return value


class Hold:
    """A task's place under its caps, from its admission until `settle`."""

    def __init__(self, settle: Callable[[float], None]) -> None:
        self._settle: Callable[[float], None] | None = settle

    def settle(self, cost: float) -> None:
        """The task's real cost replaces its estimate (once; a second call does nothing)."""
        settle, self._settle = self._settle, None
        if settle is not None:
            settle(cost)


class Budgets:
    """The caps of every pipeline of a worker, kept on `clock` (wall time: windows are
    clock hours and UTC days)."""

    def __init__(
        self,
        clock: Clock | None = None,
        group: GroupShare | None = None,
        metrics: Metrics | None = None,
        *,
        saved: bool = False,
    ) -> None:
        """`saved`: the spend is saved and read back (the worker's `store.budgets`): no task
        under a cap goes before the first read (`synced`), or a restart would count from
        zero until then."""
        self.clock = clock or WallClock()
        self.group = group or GroupShare()
        self.metrics = metrics or Metrics()
        self._accounts: dict[tuple[str, str, str], _Account] = {}  # bounded: pipelines x 3 x 2
        self._waiters: set[asyncio.Future[None]] = set()
        # Caps set while the worker runs (`store.budgets`), over the pipeline files'.
        self.overrides: dict[str, BudgetSpec] = {}
        # The task partitions this worker owns (the edge says; None: every partition's
        # spend is its own, as in the Python API).
        self.owned: Callable[[], set[int]] | None = None
        self._marks: dict[tuple[str, str, str, int], tuple[int, float]] = {}  # read back
        self._unsaved: set[tuple[str, str, str, int]] = set()
        self._synced: asyncio.Event | None = asyncio.Event() if saved else None
        self._deployments: dict[str, BudgetSpec] = {}  # a deployment's caps, by its name
        # What the tasks in flight of each model (its deployments' names) may cost: bounded
        # by the models of the deployments file.
        self._model_in_flight: dict[tuple[str, ...], float] = {}

    def caps(self, pipeline: str, spec: BudgetSpec | None) -> BudgetSpec | None:
        """The caps a pipeline is held to: the ones set while it runs, else its file's."""
        return self.overrides.get(pipeline, spec)

    def override(self, overrides: dict[str, BudgetSpec]) -> None:
        """Caps set while the worker runs, replacing the last ones: tasks waiting at a cap
        raised (or removed) go on at once."""
        if overrides == self.overrides:
            return
        for name in sorted(set(overrides) | set(self.overrides)):
            if overrides.get(name) != self.overrides.get(name):
                said = overrides[name].describe() if name in overrides else "its file's"
                whose = name if name.startswith(DEPLOYMENT) else f"pipeline {name}"
                log.info("%s: spend caps now %s", whose, said)
        self.overrides = dict(overrides)
        self.changed()

    async def hold(
        self,
        pipeline: str,
        spec: BudgetSpec | None,
        lane: Lane,
        estimate: float,
        owned: Callable[[], bool] = lambda: True,
        partition: int = 0,
    ) -> Hold:
        """Admit a task that may cost `estimate` USD: at once while its pipeline is under
        its caps, else when it is again (`owned`: still this worker's task, asked after
        each wait; `Withdrawn` when it is not)."""
        if self._synced is not None and not self._synced.is_set():
            await self._synced.wait()  # the spend saved before this start, read first
        accounts = self._of(pipeline, self.caps(pipeline, spec), lane)
        waited = False
        while (full := self._full(accounts, estimate)) is not None:
            if not waited:
                waited = True
                self.metrics.budget_waits.labels(pipeline, lane.name.lower()).inc()
            self._say(pipeline, lane, full)
            gauge = self.metrics.budget_waiting.labels(pipeline, lane.name.lower())
            gauge.inc()
            try:
                await self._wait(self._to_next(full))
            finally:
                gauge.dec()
            if not owned():
                raise Withdrawn(f"pipeline {pipeline}: a task waiting at its spend cap was "
                                "given away with its partition")  # fmt: skip
            accounts = self._of(pipeline, self.caps(pipeline, spec), lane)  # set meanwhile?
        for account in accounts:
            account.in_flight += estimate
        return Hold(lambda cost: self._settle(accounts, estimate, cost, partition))

    def cap_deployments(self, caps: Mapping[str, Caps]) -> None:
        """The deployments' own caps (`llm.deployments`), over every pipeline's calls."""
        self._deployments = {
            name: BudgetSpec(usd_per_hour=c.usd_per_hour, usd_per_day=c.usd_per_day)
            for name, c in caps.items()
            if c.usd_per_hour is not None or c.usd_per_day is not None
        }

    @property
    def deployment_caps(self) -> bool:
        """Some deployment has caps (its file's, or set while the workers run): what tasks
        cost at each is booked."""
        return bool(self._deployments) or any(k.startswith(DEPLOYMENT) for k in self.overrides)

    def _deployment(self, name: str) -> BudgetSpec | None:
        """A deployment's caps: set while the workers run (`llm-streams budget
        deployment:<name>`), else its file's; None: it has none."""
        spec = self.overrides.get(DEPLOYMENT + name, self._deployments.get(name))
        if spec is None or (spec.usd_per_hour is None and spec.usd_per_day is None):
            return None
        return spec

    def deployment_wait(self, name: str) -> float:
        """Seconds until deployment `name` is under its caps again (0: it is, or has
        none): what the router leaves it out for."""
        spec = self._deployment(name)
        if spec is None:
            return 0.0
        wait = 0.0
        for account in self._of(DEPLOYMENT + name, spec, Lane.LIVE):
            if self._spent(account) >= self._share(account):
                wait = max(wait, self._to_next(account))
                if not account.said:
                    account.said = True
                    log.warning(
                        "deployment %s: at its spend cap ($%.4f of this worker's $%.4f this "
                        "%s); no call goes to it while another deployment of its model has "
                        "room", name, self._spent(account), self._share(account),
                        account.key[2],
                    )  # fmt: skip
        return wait

    async def deployments_room(
        self,
        pipeline: str,
        names: Collection[str],
        lane: Lane,
        estimate: float,
        owned: Callable[[], bool] = lambda: True,
    ) -> Hold | None:
        """A task of `pipeline` whose model the deployments `names` serve, and that may
        cost `estimate` USD, waits here, before its deadline starts, while what is left
        under their caps (less what the model's tasks in flight may cost) would not cover
        it; a task alone goes while some deployment is under its cap. None: no deployment
        of the model has caps."""
        if all(self._deployment(name) is None for name in names):
            return None
        if self._synced is not None and not self._synced.is_set():
            await self._synced.wait()
        key = tuple(sorted(names))
        waited = False
        while (wait := self._deployments_full(key, estimate)) is not None:
            if not waited:
                waited = True
                self.metrics.budget_waits.labels(pipeline, lane.name.lower()).inc()
                log.warning("pipeline %s: the deployments of its model (%s) are at their spend "
                            "caps: its %s tasks wait; nothing is dead-lettered", pipeline,
                            ", ".join(key), lane.name.lower())  # fmt: skip
            gauge = self.metrics.budget_waiting.labels(pipeline, lane.name.lower())
            gauge.inc()
            try:
                await self._wait(wait)
            finally:
                gauge.dec()
            if not owned():
                raise Withdrawn(f"pipeline {pipeline}: a task waiting at its deployments' "
                                "spend caps was given away with its partition")  # fmt: skip
        self._model_in_flight[key] = self._model_in_flight.get(key, 0.0) + estimate

        def settle(_cost: float) -> None:  # its cost is booked per deployment (`book`)
            self._model_in_flight[key] = max(0.0, self._model_in_flight[key] - estimate)
            if self._waiters:
                self.changed()

        return Hold(settle)

    def _deployments_full(self, key: tuple[str, ...], estimate: float) -> float | None:
        """Seconds to wait (at most: a task settling wakes the waiters) before a task of
        the model served by `key` may cost `estimate`; None: it may go."""
        left, soonest = 0.0, math.inf
        for name in key:
            spec = self._deployment(name)
            if spec is None:
                return None  # a deployment without caps takes it
            for account in self._of(DEPLOYMENT + name, spec, Lane.LIVE):
                soonest = min(soonest, self._to_next(account))
            wait = self.deployment_wait(name)
            if wait == 0:
                left += min(self._share(a) - self._spent(a)
                            for a in self._of(DEPLOYMENT + name, spec, Lane.LIVE))  # fmt: skip
        committed = self._model_in_flight.get(key, 0.0)
        if left <= 0 or (committed > 0 and committed + estimate > left):
            return soonest
        return None

    def book(self, costs: Mapping[str, float], partition: int) -> None:
        """What a task's calls cost at each deployment (`core.spend.Prices.split`), counted
        against the caps of those that have some."""
        for name, usd in costs.items():
            spec = self._deployment(name)
            if spec is None or usd <= 0:
                continue
            for account in self._of(DEPLOYMENT + name, spec, Lane.LIVE):
                account.spent[partition] = account.spent.get(partition, 0.0) + usd
                self._unsaved.add((*account.key, partition))

    def synced(self) -> None:
        """The caps and the spend saved were read (or could not be: then the count starts
        here): tasks under a cap may go."""
        if self._synced is not None:
            self._synced.set()

    def changed(self) -> None:
        """Something a waiting task's admission depends on changed (the group's split, the
        partitions owned): every waiting task looks again."""
        for waiter in list(self._waiters):
            if not waiter.done():
                waiter.set_result(None)

    def spent(self, pipeline: str, scope: str, window: str) -> float:
        """This worker's spend in the current `window` of a pipeline's cap over `scope`
        (all, live, replay); 0 when it has no such cap."""
        account = self._accounts.get((pipeline, scope, window))
        return self._spent(self._roll(account)) if account is not None else 0.0

    def unsaved(self) -> list[SpendMark]:
        """The partitions' spends changed since the last call, to save."""
        marks = []
        for pipeline, scope, window, partition in sorted(self._unsaved):
            account = self._accounts.get((pipeline, scope, window))
            if account is not None:
                self._roll(account)
                marks.append(SpendMark(pipeline, scope, window, partition, account.window,
                                       account.spent.get(partition, 0.0)))  # fmt: skip
        self._unsaved.clear()
        return marks

    def not_saved(self, marks: list[SpendMark]) -> None:
        """`marks` (from `unsaved`) did not reach Kafka: offered again at the next save,
        with what their partitions spent since (else a partition that spends no more would
        never be saved, and a crash would forget more than one refresh of its spend)."""
        self._unsaved.update((m.pipeline, m.scope, m.window, m.partition) for m in marks)

    def seed(self, marks: list[SpendMark]) -> None:
        """Spends saved earlier (by this worker before a restart, or a partition's earlier
        owner): a partition's spend in the current window is never less than saved."""
        for mark in marks:
            key = (mark.pipeline, mark.scope, mark.window, mark.partition)
            if (mark.index, mark.spent_usd) > self._marks.get(key, (-1, 0.0)):  # the latest
                self._marks[key] = (mark.index, mark.spent_usd)
            account = self._accounts.get((mark.pipeline, mark.scope, mark.window))
            if account is not None:
                self._take(account, mark.partition, mark.index, mark.spent_usd)
        if marks:
            self.changed()

    def _take(self, account: _Account, partition: int, index: int, spent: float) -> None:
        self._roll(account)
        if index == account.window and spent > account.spent.get(partition, 0.0):
            account.spent[partition] = spent

    def _spent(self, account: _Account) -> float:
        """This worker's spend in the account's window: its partitions'."""
        if self.owned is None:
            return sum(account.spent.values())
        mine = self.owned()
        return sum(usd for p, usd in account.spent.items() if p in mine)

    def _of(self, pipeline: str, spec: BudgetSpec | None, lane: Lane) -> list[_Account]:
        if spec is None:
            return []
        scopes: list[tuple[str, Caps | None]] = [
            (ALL, spec), (lane.name.lower(), spec.live if lane is Lane.LIVE else spec.replay),
        ]  # fmt: skip
        accounts = []
        for scope, caps in scopes:
            if caps is None:
                continue
            for window, cap in (("hour", caps.usd_per_hour), ("day", caps.usd_per_day)):
                if cap is None:
                    continue
                key = (pipeline, scope, window)
                account = self._accounts.get(key) or self._open(key, cap)
                account.cap = cap  # a cap changed: what was spent and is in flight stays
                accounts.append(self._roll(account))
        return accounts

    def _open(self, key: tuple[str, str, str], cap: float) -> _Account:
        account = _Account(key=key, cap=cap, length=WINDOWS[key[2]])
        self._accounts[key] = account
        for (pipeline, scope, window, partition), (index, spent) in self._marks.items():
            if (pipeline, scope, window) == key:
                self._take(account, partition, index, spent)
        self.metrics.budget_spent.labels(*key).set_function(
            lambda: self._spent(self._roll(account))
        )
        self.metrics.budget_cap.labels(*key).set_function(lambda: self._share(account))
        return account

    def _roll(self, account: _Account) -> _Account:
        window = math.floor(self.clock.now() / account.length)
        if window != account.window:
            account.window, account.said = window, False
            account.spent.clear()
        return account

    def _share(self, account: _Account) -> float:
        fraction = self.group.fraction
        return account.cap * (fraction if fraction is not None else 1.0)

    def _full(self, accounts: list[_Account], estimate: float) -> _Account | None:
        """The first cap the task would pass (None: it may go). A task with nothing in
        flight beside it goes while its cap is not reached, whatever its estimate."""
        for account in accounts:
            self._roll(account)
            share, spent = self._share(account), self._spent(account)
            committed = spent + account.in_flight
            if committed + estimate > share and (account.in_flight > 0 or spent >= share):
                return account
        return None

    def _to_next(self, account: _Account) -> float:
        """Seconds until the account's next window."""
        return max(0.0, (account.window + 1) * account.length - self.clock.now())

    def _say(self, pipeline: str, lane: Lane, account: _Account) -> None:
        if account.said:
            return
        account.said = True
        window = "hour" if account.length == WINDOWS["hour"] else "day"
        log.warning(
            "pipeline %s: its %s tasks wait at its spend cap ($%.4f spent, $%.4f in flight, of "
            "this worker's $%.4f this %s); nothing is dead-lettered, they go on at the next %s",
            pipeline, lane.name.lower(), self._spent(account), account.in_flight,
            self._share(account),
            window, window,
        )  # fmt: skip

    async def _wait(self, seconds: float) -> None:
        """Until `seconds` pass or `changed` (or a task's settling) wakes every waiter."""
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(woken)
        timer = self.clock.call_later(
            seconds, lambda: None if woken.done() else woken.set_result(None)
        )
        try:
            await woken
        finally:
            timer.cancel()
            self._waiters.discard(woken)

    def _settle(
        self, accounts: list[_Account], estimate: float, cost: float, partition: int
    ) -> None:
        for account in accounts:
            self._roll(account)
            account.in_flight = max(0.0, account.in_flight - estimate)
            if cost > 0:
                account.spent[partition] = account.spent.get(partition, 0.0) + cost
                self._unsaved.add((*account.key, partition))
        if accounts and self._waiters:
            self.changed()


__all__ = ["ALL", "DEPLOYMENT", "WINDOWS", "Budgets", "Hold", "SpendMark", "Withdrawn"]
