"""The Helm CLI of the chart's offline tests (`helm lint`, `helm template` of
deploy/helm/llm-streams), built once from the Go module proxy (`helm_build/` pins it)."""

from __future__ import annotations

from pathlib import Path

from streams.dev import gobuild

VERSION = "v3.22.0"
_PINS = Path(__file__).resolve().parent / "helm_build"


def binary_path() -> Path:
    """Where the built CLI lives (`LLM_STREAMS_HELM_BIN` overrides it)."""
    return gobuild.binary_path("LLM_STREAMS_HELM_BIN", f"helm-{VERSION}", "helm")


def resolve_binary() -> Path:
    """Make sure the CLI is built; return its path."""
    return gobuild.build(_PINS, "helm.sh/helm/v3/cmd/helm", binary_path())


__all__ = ["VERSION", "binary_path", "resolve_binary"]
