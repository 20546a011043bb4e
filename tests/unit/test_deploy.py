"""The monitoring files under deploy/ refer only to metrics the worker exports (and to
recording rules they define), so a renamed metric cannot silently blank a panel or an alert."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from streams.metrics import Metrics
from streams.settings import load_settings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
METRIC = re.compile(r"\bllm_streams_[a-z0-9_]+\b")
RECORDED = re.compile(r"\bllm_streams:[a-z0-9_:]+\b")


def exported_names() -> set[str]:
    metrics = Metrics()
    metrics.watch_stream(lambda: {"lag": {("t", 0): 1}, "paused": 0, "buffered": 0})
    names: set[str] = set()
    for family in metrics.registry.collect():
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"],
                    "gauge": [""]}.get(family.type, [""])  # fmt: skip
        names.update(family.name + s for s in suffixes)
    return names


def rules() -> list[dict[str, Any]]:
    spec = yaml.safe_load((DEPLOY / "prometheus" / "rules.yml").read_text())
    return [rule for group in spec["groups"] for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    dash = json.loads((DEPLOY / "grafana" / "dashboards" / "llm-streams.json").read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def test_every_metric_named_in_rules_and_dashboard_is_exported() -> None:
    exported = exported_names()
    exprs = [r["expr"] for r in rules()] + dashboard_exprs()
    used = {m for e in exprs for m in METRIC.findall(e)}
    assert used, "no metric found: the check would pass vacuously"
    assert used <= exported, sorted(used - exported)


def test_recording_rules_used_are_defined_and_alerts_say_what_to_do() -> None:
    defined = {r["record"] for r in rules() if "record" in r}
    used = {
        m for e in [r["expr"] for r in rules()] + dashboard_exprs() for m in RECORDED.findall(e)
    }
    assert used <= defined, sorted(used - defined)
    alerts = [r for r in rules() if "alert" in r]
    assert {a["alert"] for a in alerts} >= {"LLMStreamsBreakerOpen", "LLMStreamsDeadLetterRate",
                                            "LLMStreamsLagGrowing", "LLMStreamsThrottled",
                                            "LLMStreamsCostBurn"}  # fmt: skip
    for alert in alerts:
        assert alert["labels"]["severity"] in {"page", "ticket"}
        assert alert["annotations"]["summary"] and alert["annotations"]["runbook"]


def test_the_scrape_config_points_at_the_workers_web_port() -> None:
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = prom["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["dns_sd_configs"][0]["port"] == load_settings().web_port
