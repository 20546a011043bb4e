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
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from streams.dev.brokers.common import free_port, wait_for_port
from streams.dev.brokers.tls import TlsFiles

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


SECURED = ("SASL_SSL", "SSL", "SASL_PLAINTEXT")


@dataclass(frozen=True)
class Secured:
    """Secured listeners of a one-node test cluster, beside its PLAINTEXT one (which the
    harness uses as a super user to make topics and ACLs): SASL_SSL and SASL_PLAINTEXT
    with SCRAM-SHA-256/512 users made at format time and PLAIN users, and SSL that
    requires a client certificate (principal: its CN). `acls`: the KRaft
    StandardAuthorizer is on, so only what ACLs grant is allowed."""

    tls: TlsFiles
    scram: dict[str, str] = field(default_factory=dict)
    plain: dict[str, str] = field(default_factory=dict)
    acls: bool = False


class ApacheKafka:
    """A KRaft cluster on loopback: one node by default, or `nodes` (each broker and
    controller) with replication factor and min ISR set for them. Nodes can be stopped,
    killed and started again on the same ports and data (restart and failover tests).
    `secure` adds secured listeners (one node only)."""

    def __init__(
        self,
        jars: Path | None = None,
        heap_mb: int = 768,
        nodes: int = 1,
        secure: Secured | None = None,
    ) -> None:
        if nodes < 1:
            raise ValueError("a cluster needs at least one node")
        if secure is not None and nodes != 1:
            raise ValueError("secured listeners are for a one-node cluster")
        self.jars = jars
        self.heap_mb = heap_mb
        self.nodes = nodes
        self.secure = secure
        self.secure_ports = {name: free_port() for name in SECURED} if secure else {}
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

    def secured_url(self, protocol: str) -> str:
        """`kafka://127.0.0.1:<port>` of the secured listener of `protocol`."""
        return f"kafka://127.0.0.1:{self.secure_ports[protocol]}"

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
        if self.secure is not None:
            props.update(self._secured_props(port, controller))
        path = workdir / "server.properties"
        path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        return path

    def _secured_props(self, port: int, controller: int) -> dict[str, str]:
        secure = self.secure
        assert secure is not None
        extra = ",".join(f"{name}://127.0.0.1:{p}" for name, p in self.secure_ports.items())
        scram = "org.apache.kafka.common.security.scram.ScramLoginModule required;"
        plain_users = " ".join(f'user_{u}="{pw}"' for u, pw in secure.plain.items())
        plain = f"org.apache.kafka.common.security.plain.PlainLoginModule required {plain_users};"
        props = {
            "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller},"
            + extra,
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}," + extra,
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,"
            + ",".join(f"{n}:{n}" for n in SECURED),
            "inter.broker.listener.name": "PLAINTEXT",
            "sasl.enabled.mechanisms": "SCRAM-SHA-512,SCRAM-SHA-256,PLAIN",
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(secure.tls.broker_keystore),
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(secure.tls.ca),
            "listener.name.ssl.ssl.client.auth": "required",
            # A client certificate's principal is its CN (User:worker).
            "ssl.principal.mapping.rules": "RULE:^CN=([^,]*).*$/$1/,DEFAULT",
        }
        for listener in ("sasl_ssl", "sasl_plaintext"):
            props[f"listener.name.{listener}.scram-sha-512.sasl.jaas.config"] = scram
            props[f"listener.name.{listener}.scram-sha-256.sasl.jaas.config"] = scram
            props[f"listener.name.{listener}.plain.sasl.jaas.config"] = plain
        if secure.acls:
            props["authorizer.class.name"] = (
                "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
            )
            # The broker's own connections (PLAINTEXT, controller) are ANONYMOUS.
            props["super.users"] = "User:ANONYMOUS;User:admin"
        return props

    def _format(self, attempts: int = 2) -> None:
        """Format every node's storage (with the SCRAM users). A failed format says why
        (the tool's own output) and is tried once more with a new cluster id: one
        failed once in CI, with its output discarded, and passed on every rerun."""
        scram: list[str] = []
        for name, password in (self.secure.scram if self.secure else {}).items():
            for mechanism in ("SCRAM-SHA-512", "SCRAM-SHA-256"):
                scram += ["--add-scram", f"{mechanism}=[name={name},password={password}]"]
        for attempt in range(1, attempts + 1):
            cluster_id = _cluster_id()
            for node in range(self.nodes):
                done = subprocess.run(
                    [*self._jvm, "kafka.tools.StorageTool", "format", "-t", cluster_id,
                     "-c", str(self._config(node)), *scram],
                    capture_output=True, text=True,
                )  # fmt: skip
                if done.returncode != 0:
                    said = (done.stdout + done.stderr).strip()[-2000:]
                    if attempt == attempts:
                        raise RuntimeError(f"kafka StorageTool format failed: {said}")
                    log.warning("kafka StorageTool format failed, once more: %s", said)
                    for data in self.workdir.glob("node-*/data") if self.workdir else ():
                        shutil.rmtree(data, ignore_errors=True)
                    break
            else:
                return

    def start(self, timeout_s: float = 90.0) -> ApacheKafka:
        jars = resolve_jars(self.jars)
        self.workdir = Path(tempfile.mkdtemp(prefix="llm-streams-kafka-"))
        self._jvm = [_java(), f"-Xmx{self.heap_mb}m", "-Xms128m", "-XX:+UseSerialGC",
                     "-cp", f"{jars}/*"]  # fmt: skip
        self._format()
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
