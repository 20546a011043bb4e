"""Apache Kafka 4.x in KRaft mode from Maven Central jars, on the machine's Java 17.

Used by the tests and benchmarks: the jars are resolved once with `mvn` into a
cache folder reused across runs; each broker gets a temp dir, a fresh KRaft
config, formatted storage and free loopback ports.
"""

from __future__ import annotations

import base64
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import uuid
from pathlib import Path
from types import TracebackType

from streams.brokers.common import free_port, wait_for_port

log = logging.getLogger(__name__)

KAFKA_VERSION = "4.1.1"

_POM = f"""<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>llm-streams</groupId><artifactId>kafka-jars</artifactId><version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.kafka</groupId><artifactId>kafka_2.13</artifactId>
      <version>{KAFKA_VERSION}</version>
    </dependency>
  </dependencies>
</project>
"""


def jars_dir() -> Path:
    """Cache folder of the broker's jars (`LLM_STREAMS_KAFKA_JARS` overrides it)."""
    override = os.environ.get("LLM_STREAMS_KAFKA_JARS")
    if override:
        return Path(override)
    return Path.home() / ".cache" / "llm-streams" / f"kafka-{KAFKA_VERSION}"


def resolve_jars(target: Path | None = None) -> Path:
    """Make sure the Kafka jars are in the cache; return the folder."""
    target = target or jars_dir()
    marker = target / f"kafka_2.13-{KAFKA_VERSION}.jar"
    if marker.exists():
        return target
    mvn = shutil.which("mvn")
    if mvn is None:
        raise RuntimeError("Maven (mvn) is needed once to fetch the Kafka jars; install it")
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        pom = Path(work) / "pom.xml"
        pom.write_text(_POM)
        cmd = [
            mvn, "-q", "-B", "-f", str(pom), "dependency:copy-dependencies",
            f"-DoutputDirectory={target}", "-DincludeScope=runtime",
        ]  # fmt: skip
        log.info("resolving Kafka %s jars into %s", KAFKA_VERSION, target)
        subprocess.run(cmd, check=True, cwd=work)
    if not marker.exists():
        raise RuntimeError(f"mvn finished but {marker} is missing")
    return target


def _cluster_id() -> str:
    """A KRaft cluster id that, like Kafka's own, never starts with "-" (read as a flag)."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


def _java() -> str:
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").exists():
        return str(Path(home) / "bin" / "java")
    java = shutil.which("java")
    if java is None:
        raise RuntimeError("Java 17+ is needed to run Apache Kafka 4")
    return java


class ApacheKafka:
    """One single-node KRaft broker+controller on loopback."""

    def __init__(self, jars: Path | None = None, heap_mb: int = 768) -> None:
        self.jars = jars
        self.heap_mb = heap_mb
        self.port = free_port()
        self.controller_port = free_port()
        self.workdir: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"kafka://{self.bootstrap}"

    def _config(self, workdir: Path) -> Path:
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "controller.quorum.voters": f"1@127.0.0.1:{self.controller_port}",
            "log.dirs": str(workdir / "data"),
            "num.partitions": "1",
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "4",
            "group.initial.rebalance.delay.ms": "0",
            "auto.create.topics.enable": "true",
            "log.flush.interval.messages": "9223372036854775807",
        }
        path = workdir / "server.properties"
        path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        return path

    def start(self, timeout_s: float = 90.0) -> ApacheKafka:
        jars = resolve_jars(self.jars)
        self.workdir = Path(tempfile.mkdtemp(prefix="llm-streams-kafka-"))
        config = self._config(self.workdir)
        classpath = f"{jars}/*"
        java = _java()
        cluster_id = _cluster_id()
        jvm = [java, f"-Xmx{self.heap_mb}m", "-Xms128m", "-XX:+UseSerialGC", "-cp", classpath]
        subprocess.run(
            [*jvm, "kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(config)],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        log_path = self.workdir / "broker.log"
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(
                [*jvm, "kafka.Kafka", str(config)], stdout=out, stderr=subprocess.STDOUT
            )
        self.proc = proc
        try:
            wait_for_port("127.0.0.1", self.port, timeout_s, alive=lambda: proc.poll() is None)
        except Exception:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def __enter__(self) -> ApacheKafka:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
