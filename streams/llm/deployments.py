"""Deployments: where a model name of the pipelines is served, each at its own key,
limits and price.

A deployments file (`LLM_STREAMS_LLM__DEPLOYMENTS_FILE`) maps a pipeline's model name
to one or more deployments — several keys or projects of a provider, Azure OpenAI
deployments in several regions, a provider beside a self-hosted server:

    deployments:
      - name: east                      # the breaker's, limiter's and metrics' name
        model: gpt-4o-mini              # the name pipelines use
        base_url: https://east.example.com/v1
        api_key_env: EAST_KEY           # or api_key_file: /run/secrets/east
        rpm: 3000                       # optional starting limits (learned from there)
        price_per_1k_prompt_usd: 0.00015
        usd_per_day: 200                # optional spend caps (and usd_per_hour)
      - name: west
        model: gpt-4o-mini
        auth: azure                     # `api-key` header, /openai/deployments/<name>/
        base_url: https://west.openai.azure.com
        provider_model: mini-prod       # the Azure deployment's name
        api_version: "2024-10-21"
        api_key_file: /run/secrets/west

Each deployment has its own breaker, rate limiter and concurrency limit; a call goes
to the one that can take it soonest (`resilience.router`). A deployment may have spend
caps (`usd_per_hour`, `usd_per_day`, as LiteLLM's per-deployment `max_budget`): at its
cap it takes no call while another of its model's has room; when all are at theirs,
the model's tasks wait for the next window, nothing dead-lettered (`core.budget`).

A model the file does not name is served by the endpoint of `OPENAI_BASE_URL` /
`OPENAI_API_KEY` as before, which stays the only deployment when there is no file. Keys
are read once at start, from the environment variable or file each deployment names,
and never printed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from streams.contract.mistakes import WRITTEN, mistakes_of
from streams.errors import ConfigError

DEFAULT = "default"  # the deployment of OPENAI_BASE_URL / OPENAI_API_KEY


class DeploymentSpec(BaseModel):
    """One deployment as the file declares it."""

    model_config = WRITTEN

    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,39}$",
        description="Its name in metrics, logs and status (bounded labels: keep it short).",
    )
    model: str = Field(min_length=1, description="The model name pipelines ask for.")
    base_url: str | None = Field(
        None, description="OpenAI-compatible endpoint (Azure: the resource's endpoint)."
    )
    api_key_env: str | None = Field(None, description="The environment variable of its key.")
    api_key_file: Path | None = Field(None, description="A file holding its key.")
    provider_model: str | None = Field(
        None, description="The provider's model name (Azure: the deployment's); unset: `model`."
    )
    auth: Literal["bearer", "azure"] = Field(
        "bearer", description="`Authorization: Bearer <key>`, or Azure's `api-key` header."
    )
    api_version: str | None = Field(None, description="Azure's `api-version` (auth: azure).")
    headers: dict[str, str] = Field(default_factory=dict, description="Headers of every call.")
    rpm: float | None = Field(None, gt=0, description="Requests/min to start from.")
    tpm: float | None = Field(None, gt=0, description="Tokens/min to start from.")
    weight: float = Field(1.0, gt=0, description="Its share of calls while all have room.")
    price_per_1k_prompt_usd: float | None = Field(None, ge=0, description="Unset: the llm's.")
    price_per_1k_cached_prompt_usd: float | None = Field(None, ge=0)
    price_per_1k_completion_usd: float | None = Field(None, ge=0)
    usd_per_hour: float | None = Field(
        None, gt=0, description="Spend cap per clock hour, every pipeline's calls together."
    )
    usd_per_day: float | None = Field(None, gt=0, description="Spend cap per UTC day.")

    @model_validator(mode="after")
    def _consistent(self) -> DeploymentSpec:
        if self.api_key_env and self.api_key_file:
            raise ValueError("give api_key_env or api_key_file, not both")
        if self.auth == "azure" and (self.base_url is None or self.api_version is None):
            raise ValueError("auth: azure needs base_url (the resource) and api_version")
        return self


class DeploymentsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    deployments: list[DeploymentSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> DeploymentsFile:
        names = [d.name for d in self.deployments]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"deployment names must be unique: {', '.join(twice)} twice")
        if DEFAULT in names:
            raise ValueError(f"{DEFAULT!r} is the name of OPENAI_BASE_URL's deployment")
        return self


@dataclass(frozen=True)
class AzureDeployment:
    """An Azure OpenAI deployment: its resource's endpoint, its name (in the path) and
    the `api-version` asked."""

    endpoint: str
    deployment: str
    api_version: str


@dataclass(frozen=True)
class Deployment:
    """A deployment ready to call: its spec with its key read."""

    spec: DeploymentSpec
    api_key: str | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def provider_model(self) -> str:
        return self.spec.provider_model or self.spec.model

    @property
    def azure(self) -> AzureDeployment | None:
        """Where Azure OpenAI serves it (auth: azure), else None."""
        spec = self.spec
        if spec.auth != "azure" or spec.base_url is None or spec.api_version is None:
            return None
        return AzureDeployment(spec.base_url, self.provider_model, spec.api_version)


def load_deployments(path: Path) -> list[Deployment]:
    """The deployments a file declares, their keys read; a mistake is a ConfigError that
    names the file and the field (never a key)."""
    where = f"{path} (LLM_STREAMS_LLM__DEPLOYMENTS_FILE)"
    return [Deployment(spec, _key_of(spec, where)) for spec in read_deployments(path)]


def read_deployments(path: Path) -> list[DeploymentSpec]:
    """The deployments a file declares, their keys not read (an operator's command)."""
    where = f"{path} (LLM_STREAMS_LLM__DEPLOYMENTS_FILE)"
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not YAML: {' '.join(str(exc).split())}") from None
    try:
        declared = DeploymentsFile.model_validate(raw)
    except ValidationError as exc:
        listed = "".join(f"\n  {m}" for m in mistakes_of(exc, DeploymentsFile))
        raise ConfigError(f"{where}: mistakes:{listed}") from None
    return declared.deployments


def _key_of(spec: DeploymentSpec, where: str) -> str | None:
    if spec.api_key_env:
        key = os.environ.get(spec.api_key_env, "").strip()
        if not key:
            raise ConfigError(f"{where}: deployment {spec.name}: {spec.api_key_env} is not set")
        return key
    if spec.api_key_file:
        try:
            key = spec.api_key_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"{where}: deployment {spec.name}: cannot read "
                              f"{spec.api_key_file}: {exc.strerror}") from None  # fmt: skip
        if not key:
            raise ConfigError(f"{where}: deployment {spec.name}: {spec.api_key_file} is empty")
        return key
    return None


def by_model(deployments: list[Deployment]) -> dict[str, list[Deployment]]:
    """The deployments of each model name, in the file's order."""
    out: dict[str, list[Deployment]] = {}
    for deployment in deployments:
        out.setdefault(deployment.spec.model, []).append(deployment)
    return out


__all__ = [
    "DEFAULT",
    "AzureDeployment",
    "Deployment",
    "DeploymentSpec",
    "by_model",
    "load_deployments",
    "read_deployments",
]
