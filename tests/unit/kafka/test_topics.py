"""The pipelines' sink topics at start: a topic just made is asked for again until the
brokers' metadata holds it (Kafka answers UNKNOWN_TOPIC_OR_PARTITION for a moment after
CreateTopics), one this principal may not describe is said at once, and a sink that is
one of the worker's own topics is refused."""

from __future__ import annotations

from typing import Any

import pytest

from streams.errors import ConfigError
from streams.kafka import topics
from streams.kafka.topics import ensure_sinks, ensure_topics, sessions_topic, written_topics
from streams.settings import load_settings


class Admin:
    """A broker whose metadata holds a topic only after `late` describes of it."""

    def __init__(self, late: int = 2, denied: frozenset[str] = frozenset()) -> None:
        self.late, self.denied = late, denied
        self.created: list[str] = []
        self.asked = 0

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def list_topics(self) -> list[str]:
        return []

    async def create_topics(self, wanted: list[Any], timeout_ms: int) -> Any:
        self.created += [t.name for t in wanted]
        return type("R", (), {"topic_errors": [(t.name, 0) for t in wanted]})()

    async def describe_topics(self, names: list[str]) -> list[dict[str, Any]]:
        self.asked += 1
        out = []
        for name in names:
            if name in self.denied:
                out.append({"topic": name, "error_code": 29, "partitions": []})
            elif self.asked <= self.late:  # not in the metadata yet
                out.append({"topic": name, "error_code": 3, "partitions": []})
            else:
                out.append({"topic": name, "error_code": 0, "partitions": [{}, {}, {}]})
        return out


async def test_a_sink_just_made_is_waited_for_in_the_metadata(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    admin = Admin(late=2)
    monkeypatch.setattr(topics.clients, "admin", lambda *a, **k: admin)
    counts = await ensure_sinks(load_settings(), {"shop.analysed": ["reviews"]})
    assert counts == {"shop.analysed": 3} and admin.created == ["shop.analysed"]
    assert admin.asked == 3  # twice not there yet, then there


async def test_a_sink_that_cannot_be_described_or_is_the_workers_own_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = load_settings()
    monkeypatch.setattr(topics.clients, "admin",
                        lambda *a, **k: Admin(late=0, denied=frozenset({"x"})))  # fmt: skip
    with pytest.raises(ConfigError, match="may not DESCRIBE"):
        await ensure_sinks(settings, {"x": ["p"]})
    with pytest.raises(ConfigError, match="topics the worker reads or keeps its state in"):
        await ensure_sinks(settings, {settings.topics.results: ["p"]})
    with pytest.raises(ConfigError, match="not in the brokers' metadata"):
        monkeypatch.setattr(topics.clients, "admin", lambda *a, **k: Admin(late=10**6))
        await ensure_sinks(settings, {"y": ["p"]}, timeout_s=0.5)


class Cluster(Admin):
    """Topics with their partition counts; one missing is made with the count asked."""

    def __init__(self, counts: dict[str, int]) -> None:
        super().__init__(late=0)
        self.counts = counts

    async def list_topics(self) -> list[str]:
        return list(self.counts)

    async def create_topics(self, wanted: list[Any], timeout_ms: int) -> Any:
        self.counts.update({t.name: t.num_partitions for t in wanted})
        return await super().create_topics(wanted, timeout_ms)

    async def describe_topics(self, names: list[str]) -> list[dict[str, Any]]:
        return [{"topic": n, "error_code": 0, "partitions": [{}] * self.counts[n]} for n in names]


async def test_task_topics_with_partitions_added_later_are_taken_a_new_deployment_is_not(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Kafka cannot take partitions away: a task topic given more after the store's topics
    were made stopped every start for good ("repartition them" cannot be done). It is
    taken, said, its extra partitions' records forwarded home. The same count on a task
    topic whose results topic is made at this start (a new deployment) is the setting's
    mistake, refused as before — now before any topic is made; so is any other topic's
    count."""
    settings = load_settings(kafka={"partitions": 4})
    names = written_topics(settings)
    t = settings.topics
    cluster = Cluster({name: 4 for name in names} | {t.tasks: 6})
    monkeypatch.setattr(topics.clients, "admin", lambda *a, **k: cluster)
    assert await ensure_topics(settings, names) == []
    assert "have more partitions than LLM_STREAMS_KAFKA__PARTITIONS=4" in caplog.text
    cluster = Cluster({t.tasks: 6})  # a new deployment: refused before any topic is made
    with pytest.raises(ConfigError, match="partition count other than"):
        await ensure_topics(settings, names)
    assert cluster.created == []  # made with 4, they were refused once the setting said 6
    cluster = Cluster({name: 4 for name in names if name != sessions_topic(settings)}
                      | {t.tasks: 6})  # a store topic a later release adds: made  # fmt: skip
    assert await ensure_topics(settings, names) == [sessions_topic(settings)]
    cluster = Cluster({name: 4 for name in names} | {t.tasks: 6, t.results: 6})
    with pytest.raises(ConfigError, match=r"\{'llm-results': 6\}"):
        await ensure_topics(settings, names)
    cluster = Cluster({name: 4 for name in names} | {t.tasks: 3})
    with pytest.raises(ConfigError, match="partition count other than"):
        await ensure_topics(settings, names)
