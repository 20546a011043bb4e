"""Every topic llm-streams reads or writes, and their creation on the broker."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from streams.errors import ConfigError
from streams.kafka import clients
from streams.settings import Settings

log = logging.getLogger(__name__)


def state_topic(settings: Settings) -> str:
    """The task store's task-state topic (compacted, co-partitioned with the tasks)."""
    return f"{settings.app_id}-task-state-changelog"


def ledger_topic(settings: Settings) -> str:
    """The batch lane's ledger: batches sent and which requests each holds (compacted,
    co-partitioned with the tasks)."""
    return f"{settings.app_id}-batch-ledger"


def sessions_topic(settings: Settings) -> str:
    """The task store's sessions map: each session's turns, by session id (compacted,
    co-partitioned with the tasks: a session's tasks are answered on its partition)."""
    return f"{settings.app_id}-sessions-changelog"


def replays_topic(settings: Settings) -> str:
    """Replay checkpoints, keyed by replay id (compacted)."""
    return f"{settings.app_id}-replays"


def decisions_topic(settings: Settings) -> str:
    """Decisions taken on prompt versions (`ab promote`): who, when, why; never deleted."""
    return f"{settings.app_id}-decisions"


def drift_baselines_topic(settings: Settings) -> str:
    """Drift baselines by `pipeline/version` (`llm-streams drift --save-baseline`; compacted)."""
    return f"{settings.app_id}-drift-baselines"


def budgets_topic(settings: Settings) -> str:
    """Spend caps set by `llm-streams budget`, by pipeline, over its file's (compacted)."""
    return f"{settings.app_id}-budgets"


def budget_spend_topic(settings: Settings) -> str:
    """Each task partition's spend in its pipelines' cap windows (compacted): a restarted
    worker, or a partition's next owner, goes on counting from it."""
    return f"{settings.app_id}-budget-spend"


def topic_specs(settings: Settings) -> dict[str, dict[str, str]]:
    """Topic name -> config. Results are keyed by result_key and compacted."""
    t = settings.topics
    return {
        t.tasks: {},
        t.replay: {},
        t.results: {"cleanup.policy": "compact"},
        t.dead_letters: {},
        t.review: {},
        state_topic(settings): {"cleanup.policy": "compact"},
        ledger_topic(settings): {"cleanup.policy": "compact"},
        sessions_topic(settings): {"cleanup.policy": "compact"},
        replays_topic(settings): {"cleanup.policy": "compact"},
        decisions_topic(settings): {"cleanup.policy": "delete", "retention.ms": "-1"},
        drift_baselines_topic(settings): {"cleanup.policy": "compact"},
        budgets_topic(settings): {"cleanup.policy": "compact"},
        budget_spend_topic(settings): {"cleanup.policy": "compact"},
    }


def written_topics(settings: Settings) -> list[str]:
    """Topics the worker reads and writes (each record it writes must fit the topic's
    limit); it makes no other."""
    t = settings.topics
    return [t.tasks, t.replay, t.results, t.dead_letters, t.review, state_topic(settings),
            ledger_topic(settings), sessions_topic(settings)]  # fmt: skip


async def ensure_topics(
    settings: Settings, names: list[str] | None = None, *, timeout_s: float = 30.0
) -> list[str]:
    """Create missing topics (all of the project's, or `names` of them: a command
    touches only its own, and needs ACLs for no more) with the configured partitions;
    check those co-partitioned with the tasks have that many. Returns the names created."""
    specs = topic_specs(settings)
    names = list(specs) if names is None else names
    admin = clients.admin(settings, request_timeout_ms=int(timeout_s * 1000))
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        wanted = [
            NewTopic(
                name=name,
                num_partitions=settings.kafka.partitions,
                replication_factor=settings.kafka.replication_factor,
                topic_configs=specs[name],
            )
            for name in names
            if name not in existing
        ]
        created = []
        if wanted:
            # The topics there first: a mismatch refused before any topic is made (made
            # with the setting's count, they would be refused after it is set right).
            await _check_partitions(admin, settings, [n for n in names if n in existing],
                                    [t.name for t in wanted], say=False)  # fmt: skip
            response = await admin.create_topics(wanted, timeout_ms=int(timeout_s * 1000))
            created = _created(response, [t.name for t in wanted])
            log.info("created topics %s", created)
        await _check_partitions(admin, settings, names, created)
        return created
    finally:
        await admin.close()


async def ensure_sinks(
    settings: Settings,
    sinks: dict[str, list[str]],
    sources: list[str] | tuple[str, ...] = (),
    *,
    timeout_s: float = 30.0,
) -> dict[str, int]:
    """The pipelines' sink topics (topic -> the pipelines writing it): each must be none
    of the worker's own topics nor a source (a ConfigError says which); one missing is
    made, compacted (a sink record is keyed by its task: the latest per key is the
    answer) with the task topics' partition count. Returns each one's partition count."""
    if not sinks:
        return {}
    own = set(topic_specs(settings)) | set(sources)
    clash = {topic: names for topic, names in sinks.items() if topic in own}
    if clash:
        raise ConfigError(
            f"sink topics {clash} are topics the worker reads or keeps its state in: a sink "
            "needs a topic of its own"
        )
    admin = clients.admin(settings, request_timeout_ms=int(timeout_s * 1000))
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        wanted = [NewTopic(name=name, num_partitions=settings.kafka.partitions,
                           replication_factor=settings.kafka.replication_factor,
                           topic_configs={"cleanup.policy": "compact"})
                  for name in sorted(sinks) if name not in existing]  # fmt: skip
        if wanted:
            response = await admin.create_topics(wanted, timeout_ms=int(timeout_s * 1000))
            log.info("created sink topics %s", _created(response, [t.name for t in wanted]))
        return await _partition_counts(admin, sorted(sinks), timeout_s)
    finally:
        await admin.close()


async def _partition_counts(
    admin: AIOKafkaAdminClient, names: list[str], timeout_s: float
) -> dict[str, int]:
    """Each topic's partition count, asked again while a topic just made is not yet in
    the brokers' metadata (for up to `timeout_s`); one this principal may not describe is
    a clear error at once."""
    counts: dict[str, int] = {}
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        denied = []
        for description in await admin.describe_topics([n for n in names if n not in counts]):
            code = description.get("error_code", 0)
            if code == 0 and description["partitions"]:
                counts[description["topic"]] = len(description["partitions"])
            elif code == _TOPIC_DENIED:
                denied.append(description["topic"])
        if denied:
            raise ConfigError(f"this Kafka principal may not DESCRIBE topics {sorted(denied)}: "
                              "grant DESCRIBE on them")  # fmt: skip
        missing = sorted(set(names) - set(counts))
        if not missing:
            return counts
        if asyncio.get_running_loop().time() >= deadline:
            raise ConfigError(f"sink topics {missing} are not in the brokers' metadata "
                              f"{timeout_s:g}s after they were made")  # fmt: skip
        await asyncio.sleep(0.2)


_EXISTS, _TOPIC_DENIED, _CLUSTER_DENIED = 36, 29, 31


def _created(response: Any, names: list[str]) -> list[str]:
    """The topics a CreateTopics answer says were made; a topic a concurrent worker made
    is fine; one this principal may not create is a clear error (topics can be made
    ahead of time: docs/SECURITY.md)."""
    denied, failed = [], []
    for name, code, *rest in response.topic_errors:
        if code in (_TOPIC_DENIED, _CLUSTER_DENIED):
            denied.append(name)
        elif code not in (0, _EXISTS):
            failed.append(f"{name}: {(rest[0] if rest else None) or f'error {code}'}")
    if denied:
        raise ConfigError(
            f"topics {sorted(denied)} do not exist and this Kafka principal may not create "
            "them (no CREATE ACL): create them ahead of time with the partitions and configs "
            "docs/SECURITY.md lists, or grant CREATE on them"
        )
    if failed:
        raise ConfigError("cannot create topics: " + "; ".join(failed))
    return [n for n in names if n not in denied]


async def _check_partitions(
    admin: AIOKafkaAdminClient,
    settings: Settings,
    among: list[str],
    created: list[str],
    *,
    say: bool = True,
) -> None:
    """The task store is co-partitioned with the task topics: every topic it reads or
    writes needs `kafka.partitions` partitions. The task topics may have more when
    partitions were added to them after the store's topics were made (Kafka cannot take
    them away): records there are forwarded to their tasks' partitions (`worker.flow`).
    More on a task topic when the results topic is made at this start is a new deployment
    whose setting is not its topics' count: refused, as any other mismatch. `say`: log
    the task topics' extra partitions (once a start, after the check of what it made)."""
    t = settings.topics
    n = settings.kafka.partitions
    task_topics = {t.tasks, t.replay}
    store_topics = {t.results, t.dead_letters, state_topic(settings), ledger_topic(settings),
                    sessions_topic(settings)}  # fmt: skip
    names = [name for name in (*task_topics, *store_topics) if name in among]
    if not names:
        return
    found: dict[str, int] = {}
    denied = []
    for description in await admin.describe_topics(sorted(names)):
        code = description.get("error_code", 0)
        if code == 0:
            found[description["topic"]] = len(description["partitions"])
        elif code == _TOPIC_DENIED:
            denied.append(description["topic"])
    if denied:
        raise ConfigError(
            f"this Kafka principal may not DESCRIBE topics {sorted(denied)}: grant the "
            "ACLs docs/SECURITY.md lists for a worker"
        )
    more = {name: c for name, c in found.items() if name in task_topics and c > n}
    new_store = t.results in created  # nothing answered yet: a new deployment
    wrong = {name: c for name, c in found.items() if c != n and (name not in more or new_store)}
    if wrong:
        raise ConfigError(
            f"topics {wrong} have a partition count other than "
            f"LLM_STREAMS_KAFKA__PARTITIONS={n}; the task store "
            "needs the task, replay, results and dead-letter topics co-partitioned. "
            "Set LLM_STREAMS_KAFKA__PARTITIONS to theirs or repartition them."
        )
    if more and say:
        log.warning(
            "topics %s have more partitions than LLM_STREAMS_KAFKA__PARTITIONS=%d (added "
            "after the task store's topics were made?): the store keeps %d, so records on "
            "the partitions past them are forwarded to their tasks' partitions and answered "
            "there; the extra partitions add no room for workers (docs/OPERATIONS.md)",
            more,
            n,
            n,
        )
