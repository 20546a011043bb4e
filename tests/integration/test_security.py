"""A secured Kafka (Apache Kafka from the jars): SASL_SSL with SCRAM users, an SSL
listener that requires client certificates, and — on a second cluster — the KRaft
StandardAuthorizer with only the ACLs docs/SECURITY.md lists. The worker answers end to
end over each; the commands work; a wrong password, CA or an expired certificate stops
the start within seconds with a message naming the setting, and no secret in the logs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from streams.dev.brokers.acls import grant
from streams.dev.brokers.apache import ApacheKafka, Secured
from streams.dev.brokers.tls import TlsFiles, make_tls_files
from streams.dev.simulator import SimulatorServer
from streams.kafka.acls import command_acls, worker_acls
from streams.kafka.topics import ensure_topics
from streams.settings import Settings
from tests.integration.helpers import (
    WorkerProcess,
    assert_each_task_answered_once,
    collect,
    run_cli,
)

pytestmark = pytest.mark.integration

WORKER_PW = "w0rker-Secret-9f3a"  # never to be seen in a log line
OPERATOR_PW = "0perator-Secret-c1d2"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def secured(pki: TlsFiles) -> Iterator[ApacheKafka]:
    users = {"worker": WORKER_PW, "operator": OPERATOR_PW}
    with ApacheKafka(heap_mb=512, secure=Secured(tls=pki, scram=users)) as kafka:
        yield kafka


@pytest.fixture(scope="module")
def guarded(pki: TlsFiles) -> Iterator[ApacheKafka]:
    users = {"worker": WORKER_PW, "operator": OPERATOR_PW}
    with ApacheKafka(heap_mb=512, secure=Secured(tls=pki, scram=users, acls=True)) as kafka:
        yield kafka


def sasl_ssl(kafka: ApacheKafka, pki: TlsFiles, user: str, password: str) -> dict[str, Any]:
    return {"broker_url": kafka.secured_url("SASL_SSL"),
            "security": {"protocol": "SASL_SSL", "ssl_cafile": str(pki.ca),
                         "sasl_mechanism": "SCRAM-SHA-512", "sasl_username": user,
                         "sasl_password": password}}  # fmt: skip


def mtls(kafka: ApacheKafka, pki: TlsFiles, cert: Path, key: Path) -> dict[str, Any]:
    security: dict[str, Any] = {"protocol": "SSL", "ssl_cafile": str(pki.ca),
                                "ssl_certfile": str(cert), "ssl_keyfile": str(key)}  # fmt: skip
    if key == pki.client.key:
        security["ssl_key_password"] = pki.key_password
    return {"broker_url": kafka.secured_url("SSL"), "security": security}


def _tasks(n: int, prefix: str) -> list[dict[str, Any]]:
    return [{"task_id": f"{prefix}-{i:03d}", "pipeline": "comment-analysis",
             "input": {"text": f"Comment {i}: the lid broke, the rest is fine."}}
            for i in range(n)]  # fmt: skip


async def _answered_by_a_worker(settings: Settings, tmp_path: Path, tasks: list[Any],
                                name: str, reader: Settings | None = None) -> None:  # fmt: skip
    worker = WorkerProcess(settings, tmp_path / f"{name}.log").start()
    try:
        got = await collect(reader or settings, set(), timeout_s=120, worker=worker,
                            until=lambda g: len({r["task_id"] for r in g.results}) >= len(tasks))  # fmt: skip
    finally:
        worker.stop()
    assert not got.dead_letters, got.dead_letters[:2]
    assert_each_task_answered_once(got, {t["task_id"] for t in tasks})


def _publish(settings: Settings, tmp_path: Path, tasks: list[Any]) -> None:
    """Through the CLI (over the secured listener)."""
    lines = tmp_path / "tasks.jsonl"
    lines.write_bytes(b"\n".join(orjson.dumps(t) for t in tasks))
    done = run_cli(settings, "publish", str(lines))
    assert done.returncode == 0, done.stderr[-1500:]


async def test_the_worker_and_the_commands_work_over_sasl_ssl(
    make_settings: Any, simulator: SimulatorServer, secured: ApacheKafka, pki: TlsFiles,
    tmp_path: Path,
) -> None:  # fmt: skip
    settings = make_settings(
        kafka=sasl_ssl(secured, pki, "worker", WORKER_PW),
        llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1"},
    )  # fmt: skip
    tasks = _tasks(40, "sasl")
    await ensure_topics(settings)  # all co-partitioned before a reader auto-creates one
    _publish(settings, tmp_path, tasks)
    await _answered_by_a_worker(settings, tmp_path, tasks, "worker")
    tail = run_cli(settings, "tail", settings.topics.results, "--from-beginning", "--max", "5",
                   "--idle-timeout", "20")  # fmt: skip
    shown = [line for line in tail.stdout.splitlines() if line.startswith("sasl-")]
    assert tail.returncode == 0 and len(shown) == 5, tail.stderr
    replay = run_cli(settings, "replay", "--from", "2000-01-01T00:00Z", "--source",
                     settings.topics.tasks)  # fmt: skip
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert "40 record(s) read" in replay.stdout and "skipped 40 already answered" in replay.stdout


async def test_the_worker_works_over_mutual_tls(
    make_settings: Any, simulator: SimulatorServer, secured: ApacheKafka, pki: TlsFiles,
    tmp_path: Path,
) -> None:  # fmt: skip
    settings = make_settings(
        kafka=mtls(secured, pki, pki.client.cert, pki.client.key),
        llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1"},
    )  # fmt: skip
    tasks = _tasks(30, "mtls")
    await ensure_topics(settings)
    _publish(settings, tmp_path, tasks)
    await _answered_by_a_worker(settings, tmp_path, tasks, "worker")


@pytest.mark.parametrize("fault", ["wrong password", "wrong CA", "expired certificate"])
def test_a_wrong_secret_or_certificate_stops_the_start_fast_naming_the_setting(
    make_settings: Any, secured: ApacheKafka, pki: TlsFiles, tmp_path: Path, fault: str
) -> None:
    if fault == "wrong password":
        kafka = sasl_ssl(secured, pki, "worker", "not-" + WORKER_PW)
        named = "SASL_PASSWORD"
    elif fault == "wrong CA":
        kafka = sasl_ssl(secured, pki, "worker", WORKER_PW)
        kafka["security"]["ssl_cafile"] = str(pki.other_ca)
        named = "SSL_CAFILE"
    else:
        kafka = mtls(secured, pki, pki.expired.cert, pki.expired.key)
        named = "SSL_CERTFILE"
    settings = make_settings(kafka=kafka, log_level="debug")
    started = time.monotonic()
    done = run_cli(settings, "worker", timeout_s=60)
    took = time.monotonic() - started
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"LLM_STREAMS_KAFKA__SECURITY__{named}" in done.stderr, done.stderr[-2000:]
    assert took < 30, f"took {took:.0f}s to say so"
    for secret in (WORKER_PW, pki.key_password):
        assert secret not in done.stderr and secret not in done.stdout


async def test_with_only_the_documented_acls_the_worker_and_commands_work(
    make_settings: Any, simulator: SimulatorServer, guarded: ApacheKafka, pki: TlsFiles,
    tmp_path: Path,
) -> None:  # fmt: skip
    llm = {"base_url": simulator.base_url, "api_key": "k", "model": "sim-1"}
    settings = make_settings(kafka=sasl_ssl(guarded, pki, "worker", WORKER_PW), llm=llm)
    operator = make_settings(kafka=sasl_ssl(guarded, pki, "operator", OPERATOR_PW), llm=llm)
    operator = operator.model_copy(update={"app_id": settings.app_id,
                                           "topics": settings.topics})  # fmt: skip
    # The topics made ahead of time by an administrator (the PLAINTEXT listener's
    # principal is a super user here): the worker gets no CREATE.
    admin = settings.model_copy(update={"kafka": settings.kafka.model_copy(update={
        "broker_url": guarded.url, "security": type(settings.kafka.security)()})})  # fmt: skip
    await ensure_topics(admin)
    await grant(guarded.bootstrap, "User:worker", worker_acls(settings))
    commands = command_acls(operator)
    await grant(guarded.bootstrap, "User:operator", commands["publish"] + commands["status"])
    tasks = _tasks(20, "acl")
    _publish(operator, tmp_path, tasks)
    await _answered_by_a_worker(settings, tmp_path, tasks, "worker", reader=admin)
    status = run_cli(operator, "status", tasks[0]["task_id"])
    assert status.returncode == 0 and "succeeded" in status.stdout, status.stderr[-1500:]
    # A command without its ACL says what it may not do, at once.
    started = time.monotonic()
    refused = run_cli(operator, "redrive", "--category", "timeout", timeout_s=60)
    assert refused.returncode == 2, refused.stderr[-1500:]
    assert "not authorized" in refused.stderr.lower() and settings.topics.dead_letters in (
        refused.stderr
    ), refused.stderr[-1500:]
    assert time.monotonic() - started < 30
    await asyncio.sleep(0)
