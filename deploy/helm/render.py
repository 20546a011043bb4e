"""Write the generated files of the Helm chart deploy/helm/llm-streams from their sources
(run after editing one; tests/unit/test_deploy.py fails while one is out of date):

- files/pipelines/, files/schemas/: the repository's pipelines and output schemas, which
  the chart mounts when its values give none (Helm reads only files inside a chart);
- files/prometheus/rules.yml and files/grafana/: the alerts and the dashboard of deploy/;
- values.schema.json: the schema `helm lint`, `install` and `template` check the values
  against. Its `settings` part is the worker's own settings model (streams.settings), so a
  misspelt or mistyped setting is refused before any pod starts, and a secret given as a
  plain setting (api_key, sasl_password, ...) is refused: secrets are files (secretFiles).

    python deploy/helm/render.py
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CHART = Path(__file__).resolve().parent / "llm-streams"

COPIED = {
    "files/pipelines": (ROOT / "pipelines", "*.yaml"),
    "files/schemas": (ROOT / "schemas", "*.json"),
    "files/prometheus": (ROOT / "deploy" / "prometheus", "rules.yml"),
    "files/grafana": (ROOT / "deploy" / "grafana" / "dashboards", "*.json"),
}


def copied() -> dict[str, str]:
    """Each copied file's path in the chart -> its content."""
    return {f"{folder}/{source.name}": source.read_text(encoding="utf-8")
            for folder, (where, pattern) in COPIED.items()
            for source in sorted(where.glob(pattern))}  # fmt: skip


def _secret(node: dict[str, Any]) -> bool:
    return bool(node.get("writeOnly")) or any(o.get("writeOnly") for o in node.get("anyOf", []))


def _clean(node: Any) -> Any:
    """The settings model's schema without what Helm's check does not need (titles,
    defaults, formats) and without the secret fields."""
    if isinstance(node, list):
        return [_clean(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _clean(v) for k, v in node.items() if k not in {"title", "default", "format"}}
    if "properties" in out:
        out["properties"] = {
            k: v for k, v in out["properties"].items() if not _secret(node["properties"][k])
        }
    return out


def _object(properties: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "properties": properties, **extra}


def values_schema() -> dict[str, Any]:
    from streams.settings import Settings

    settings = _clean(Settings.model_json_schema())
    defs = settings.pop("$defs")
    string, boolean = {"type": "string"}, {"type": "boolean"}
    integer = {"type": "integer", "minimum": 0}
    files = {"type": "object", "additionalProperties": {"type": "string"}}
    free = {"type": "object"}
    folder = _object({"files": files, "existingConfigMap": string})
    secret = _object({"mountPath": {"type": "string", "pattern": "^/"}, "existingSecret": string,
                      "files": files}, required=["mountPath"])  # fmt: skip
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$defs": defs,
        **_object({
            "image": _object({"repository": string, "tag": string,
                              "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]}}),
            "imagePullSecrets": {"type": "array"},
            "replicas": integer,
            "settings": {**settings, "description": "The worker's settings (docs/SETTINGS.md), "
                         "nested as their LLM_STREAMS_* variables are."},
            "env": files,
            "secretFiles": {"type": "object", "additionalProperties": secret},
            "deployments": free,
            "pipelines": folder,
            "schemas": folder,
            "podAnnotations": files,
            "podLabels": files,
            "terminationGracePeriodSeconds": integer,
            "resources": free,
            "nodeSelector": files,
            "tolerations": {"type": "array"},
            "affinity": free,
            "persistence": _object({"size": string, "storageClassName": string}),
            "podDisruptionBudget": _object({"enabled": boolean, "maxUnavailable": integer}),
            "autoscaling": _object({"enabled": boolean, "minReplicas": integer,
                                    "maxReplicas": integer, "lagThreshold": integer,
                                    "cooldownPeriod": integer}),
            "monitoring": _object({
                "serviceMonitor": _object({"enabled": boolean, "interval": string}),
                "prometheusRule": _object({"enabled": boolean, "runbookBase": string}),
                "grafanaDashboard": _object({"enabled": boolean, "label": string}),
            }),
        }),
    }  # fmt: skip


def rendered() -> dict[str, str]:
    """Every generated file's path in the chart -> its content."""
    schema = json.dumps(values_schema(), indent=2, ensure_ascii=False) + "\n"
    return {**copied(), "values.schema.json": schema}


def write() -> None:
    for folder in COPIED:
        shutil.rmtree(CHART / folder, ignore_errors=True)
    for name, text in rendered().items():
        path = CHART / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    write()
