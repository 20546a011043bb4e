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
import time
import uuid
from pathlib import Path
from types import TracebackType

from streams.dev.brokers.common import free_port, wait_for_port

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
    """A KRaft cluster on loopback: one node by default, or `nodes` (each broker and
    controller) with replication factor and min ISR set for them. Nodes can be stopped,
    killed and started again on the same ports and data (restart and failover tests)."""

    def __init__(self, jars: Path | None = None, heap_mb: int = 768, nodes: int = 1) -> None:
        if nodes < 1:
            raise ValueError("a cluster needs at least one node")
        self.jars = jars
        self.heap_mb = heap_mb
        self.nodes = nodes
        self.ports = [free_port() for _ in range(nodes)]
        self.controller_ports = [free_port() for _ in range(nodes)]
        self.workdir: Path | None = None
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * nodes
        self._jvm: list[str] = []

    @property
    def port(self) -> int:
        return self.ports[0]

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self.procs[0]

    @property
    def bootstrap(self) -> str:
        return ",".join(f"127.0.0.1:{port}" for port in self.ports)

    @property
    def url(self) -> str:
        return "kafka://" + ";".join(f"127.0.0.1:{port}" for port in self.ports)

    def _node_dir(self, node: int) -> Path:
        assert self.workdir is not None, "cluster not started"
        return self.workdir / f"node-{node + 1}"

    def _config(self, node: int) -> Path:
        workdir = self._node_dir(node)
        workdir.mkdir(parents=True, exist_ok=True)
        port, controller = self.ports[node], self.controller_ports[node]
        voters = ",".join(f"{i + 1}@127.0.0.1:{c}" for i, c in enumerate(self.controller_ports))
        replicas = str(min(3, self.nodes))
        min_isr = str(2 if self.nodes >= 3 else 1)
        props = {
            "process.roles": "broker,controller",
            "node.id": str(node + 1),
            "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "controller.quorum.voters": voters,
            "log.dirs": str(workdir / "data"),
            "num.partitions": "1",
            "default.replication.factor": replicas,
            "min.insync.replicas": min_isr,
            "offsets.topic.replication.factor": replicas,
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.replication.factor": replicas,
            "transaction.state.log.min.isr": min_isr,
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
        self._jvm = [_java(), f"-Xmx{self.heap_mb}m", "-Xms128m", "-XX:+UseSerialGC",
                     "-cp", f"{jars}/*"]  # fmt: skip
        cluster_id = _cluster_id()
        for node in range(self.nodes):
            subprocess.run(
                [*self._jvm, "kafka.tools.StorageTool", "format", "-t", cluster_id,
                 "-c", str(self._config(node))],
                check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        try:
            for node in range(self.nodes):
                self._launch(node)
            for node in range(self.nodes):
                self._wait(node, timeout_s)
        except Exception:
            self.stop()
            raise
        return self

    def _launch(self, node: int) -> None:
        config = self._node_dir(node) / "server.properties"
        with open(self._node_dir(node) / "broker.log", "ab") as out:
            self.procs[node] = subprocess.Popen(
                [*self._jvm, "kafka.Kafka", str(config)], stdout=out, stderr=subprocess.STDOUT
            )

    def _wait(self, node: int, timeout_s: float) -> None:
        proc = self.procs[node]
        assert proc is not None
        wait_for_port("127.0.0.1", self.ports[node], timeout_s, alive=lambda: proc.poll() is None)

    def stop_node(self, node: int, *, kill: bool = False) -> None:
        """Stop one node, keeping its data: SIGTERM (controlled shutdown) or SIGKILL."""
        proc = self.procs[node]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs[node] = None

    def start_node(self, node: int, timeout_s: float = 90.0) -> None:
        """Start a stopped node again on its ports, with the data it had."""
        if self.procs[node] is None:
            self._launch(node)
        self._wait(node, timeout_s)

    def restart(self, *, kill: bool = False, down_s: float = 0.0) -> None:
        """Every node down (keeping data), `down_s` of silence, every node up again."""
        for node in range(self.nodes):
            self.stop_node(node, kill=kill)
        if down_s > 0:
            time.sleep(down_s)
        for node in range(self.nodes):
            self._launch(node)
        for node in range(self.nodes):
            self._wait(node, 90.0)

    def stop(self) -> None:
        for node in range(self.nodes):
            self.stop_node(node)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def __enter__(self) -> ApacheKafka:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
