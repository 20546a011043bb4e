"""Whose spend caps a name is (a pipeline's, or a deployment's: `deployment:NAME`) and
the caps its file gives it, for `llm-streams budget`."""

from __future__ import annotations

from streams.core.budget import DEPLOYMENT
from streams.errors import ConfigError
from streams.llm.deployments import read_deployments
from streams.pipelines.specs import BudgetSpec
from streams.settings import Settings


def is_deployment(name: str) -> bool:
    return name.startswith(DEPLOYMENT)


def deployment_caps(settings: Settings, name: str) -> BudgetSpec | None:
    """The caps the deployments file gives deployment `deployment:NAME` (None: none); a
    ConfigError when the file has no such deployment, or a mistake."""
    wanted = name.removeprefix(DEPLOYMENT)
    path = settings.llm.deployments_file
    specs = read_deployments(path) if path is not None else []
    spec = next((d for d in specs if d.name == wanted), None)
    if spec is None:
        raise ConfigError(f"no deployment named {wanted!r} in LLM_STREAMS_LLM__DEPLOYMENTS_FILE")
    if spec.usd_per_hour is None and spec.usd_per_day is None:
        return None
    return BudgetSpec(usd_per_hour=spec.usd_per_hour, usd_per_day=spec.usd_per_day)


__all__ = ["deployment_caps", "is_deployment"]
