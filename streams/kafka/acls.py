"""The least Kafka ACLs a worker and each command need — one list, from which
docs/SECURITY.md's tables are made (`llm-streams acls` prints them for your settings)
and which the security tests grant, nothing more.

Topics can be created ahead of time (`topic_specs`); then no CREATE is needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from streams.kafka.topics import (
    budget_spend_topic,
    budgets_topic,
    decisions_topic,
    drift_baselines_topic,
    ledger_topic,
    replays_topic,
    sessions_topic,
    state_topic,
    topic_specs,
)
from streams.settings import Settings


@dataclass(frozen=True)
class Acl:
    """Operations allowed on one resource (a literal name, or every name with a prefix)."""

    resource: str  # topic | group | transactional_id | cluster
    name: str
    operations: tuple[str, ...]
    prefixed: bool = False
    why: str = ""


def worker_acls(
    settings: Settings,
    *,
    creates_topics: bool = False,
    sources: Sequence[str] = (),
    sinks: Sequence[str] = (),
) -> list[Acl]:
    t = settings.topics
    read = ("READ", "DESCRIBE")
    write = ("WRITE", "DESCRIBE", "DESCRIBE_CONFIGS")
    both = ("READ", "WRITE", "DESCRIBE", "DESCRIBE_CONFIGS")
    acls = [
        Acl("topic", t.tasks, both, why="consumes tasks; forwards a misrouted record"),
        Acl("topic", t.replay, both, why="consumes the replay lane; forwards likewise"),
        Acl("topic", t.results, both, why="writes results; the task store reads them back"),
        Acl("topic", t.dead_letters, both, why="writes dead letters; the store reads them"),
        Acl("topic", t.review, write, why="writes review copies"),
        Acl("topic", state_topic(settings), both, why="task states (the store's changelog)"),
        Acl("topic", ledger_topic(settings), both, why="the batch lane's ledger"),
        Acl("topic", sessions_topic(settings), both, why="sessions' turns (the store's map)"),
        Acl("topic", drift_baselines_topic(settings), read, why="the drift baselines it holds to"),
        Acl("topic", budgets_topic(settings), read, why="the spend caps set by `budget`"),
        Acl(
            "topic",
            budget_spend_topic(settings),
            ("READ", "WRITE", "DESCRIBE"),
            why="its partitions' spend under the caps",
        ),
        Acl("group", settings.app_id, read, why="the consumer group"),
    ]
    acls += [Acl("topic", name, read, why="a pipeline's source topic, read as it is")
             for name in sources]  # fmt: skip
    acls += [Acl("topic", name, write, why="a pipeline's sink: its answers, in its shape")
             for name in sinks]  # fmt: skip
    if settings.processing_guarantee == "exactly_once":
        prefix = f"{settings.app_id}-eos-"
        why = "one transactional producer per task partition"
        acls.append(Acl("transactional_id", prefix, ("WRITE", "DESCRIBE"), True, why))
    if creates_topics:
        acls += [Acl("topic", name, ("CREATE",), why="created at start when missing")
                 for name in [*topic_specs(settings), *sinks]]  # fmt: skip
    return acls


def command_acls(settings: Settings) -> dict[str, list[Acl]]:
    """What each command needs beyond connecting (none of them creates topics when the
    worker's topics exist)."""
    t = settings.topics
    read = ("READ", "DESCRIBE")
    write = ("WRITE", "DESCRIBE")
    state = Acl("topic", state_topic(settings), read, why="task states")
    results = Acl("topic", t.results, read, why="what is answered")
    failed = Acl("topic", t.dead_letters, read, why="the failed tasks")
    own = ("READ", "WRITE", "DESCRIBE")
    return {
        "publish": [Acl("topic", t.tasks, write, why="the tasks it sends")],
        "tail": [
            Acl("topic", "<TOPIC>", read, why="the topic it follows"),
            Acl("group", "llm-streams-tail-", ("READ",), prefixed=True, why="its own group"),
        ],
        "replay": [
            Acl("topic", "<source, default tasks>", read, why="the history replayed"),
            results,
            Acl("topic", t.replay, write, why="the replay lane"),
            Acl("topic", replays_topic(settings), own, why="its checkpoints"),
        ],
        "backtrack": [
            state,
            Acl("topic", "<tasks' source topics>", read, why="the records it sends again"),
            results,
            Acl("topic", t.replay, write, why="the replay lane"),
        ],
        "diff": [results],
        "ab report": [results, failed],
        "ab promote": [
            results,
            failed,
            Acl("topic", decisions_topic(settings), own, why="the decision it records"),
        ],
        "ab log": [Acl("topic", decisions_topic(settings), read, why="the decisions")],
        "drift": [
            results,
            Acl(
                "topic",
                drift_baselines_topic(settings),
                own,
                why="the stored baselines (WRITE only with --save-baseline)",
            ),
        ],
        "redrive": [
            Acl("topic", t.dead_letters, read, why="the dead letters"),
            state,
            Acl("topic", t.tasks, write, why="the tasks it re-queues"),
        ],
        "status": [state],
        "erase": [Acl("topic", t.tasks, write, why="the erase requests it sends")],
        "budget": [Acl("topic", budgets_topic(settings), own, why="the spend caps it sets")],
    }


def markdown(settings: Settings, sources: Sequence[str] = (), sinks: Sequence[str] = ()) -> str:
    """The tables of docs/SECURITY.md for `settings` (a test keeps the file equal to the
    defaults' tables)."""

    def rows(acls: list[Acl]) -> list[str]:
        return [f"| {a.resource} | `{a.name}`{' (prefix)' if a.prefixed else ''} | "
                f"{', '.join(a.operations)} | {a.why} |" for a in acls]  # fmt: skip

    head = ["| resource | name | operations | why |", "| --- | --- | --- | --- |"]
    eos = settings.model_copy(update={"processing_guarantee": "exactly_once"})
    out = ["### Worker", "", *head, *rows(worker_acls(eos, sources=sources, sinks=sinks)), "",
           "The transactional id only with `exactly_once`. To let the worker create missing "
           "topics at start, add CREATE on each topic (topics made ahead of time need none):",
           "", *head, *rows([a for a in worker_acls(settings, creates_topics=True, sinks=sinks)
                             if a.operations == ("CREATE",)]), ""]  # fmt: skip
    for command, acls in command_acls(settings).items():
        out += [f"### `llm-streams {command}`", "", *head, *rows(acls), ""]
    return "\n".join(out)


__all__ = ["Acl", "command_acls", "markdown", "worker_acls"]
