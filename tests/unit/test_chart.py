"""The Helm chart (deploy/helm/llm-streams), checked offline with the real Helm CLI
(`helm lint --strict`, `helm template`; built once from the Go module proxy by
streams.dev.helm) and the rendered manifests against Kubernetes' own schemas (strict: an
unknown field fails), then read back with the worker's settings model: what the pods
would run with is what the code reads."""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from streams.llm.deployments import load_deployments

pytestmark = pytest.mark.helm

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "llm-streams"
RELEASE = "shop"
KUBERNETES = "1.37.0"


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    from streams.dev.helm import resolve_binary

    return subprocess.run([str(resolve_binary()), *args], capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def render(tmp_path: Path | None = None, values: dict[str, Any] | None = None,
           *sets: str) -> dict[tuple[str, str], dict[str, Any]]:  # fmt: skip
    """`helm template` with the chart's values plus `values` (a file) and `--set`s."""
    args = ["template", RELEASE, str(CHART), "--namespace", "shop"]
    if values is not None:
        assert tmp_path is not None
        file = tmp_path / "values.yaml"
        file.write_text(yaml.safe_dump(values))
        args += ["-f", str(file)]
    for item in sets:
        args += ["--set", item]
    out = helm(*args)
    assert out.returncode == 0, out.stderr
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out.stdout) if d}


def refused(*sets: str, values: dict[str, Any] | None = None, tmp_path: Path | None = None) -> str:
    """What `helm template` says when it refuses the values (it must refuse them)."""
    args = ["template", RELEASE, str(CHART)]
    if values is not None:
        assert tmp_path is not None
        (tmp_path / "v.yaml").write_text(yaml.safe_dump(values))
        args += ["-f", str(tmp_path / "v.yaml")]
    for item in sets:
        args += ["--set", item]
    out = helm(*args)
    assert out.returncode != 0, f"accepted: {sets or values}"
    return " ".join(out.stderr.split())


@pytest.fixture(scope="module")
def docs() -> dict[tuple[str, str], dict[str, Any]]:
    return render()


def settings_of(
    docs: dict[tuple[str, str], dict[str, Any]], monkeypatch: Any, tmp_path: Path
) -> Any:
    """The settings a pod reads from its ConfigMap. The one file the settings loader reads
    itself (the LLM key) is taken from the Secret mounted there, put under `tmp_path`."""
    from tests.unit.test_deploy import _settings_from

    pod = docs[("StatefulSet", f"{RELEASE}-worker")]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    env = dict(docs[("ConfigMap", f"{RELEASE}-settings")]["data"])
    in_pod = Path(env["LLM_STREAMS_LLM__API_KEY_FILE"])
    mount = next(m for m in pod["containers"][0]["volumeMounts"]
                 if m["mountPath"] == str(in_pod.parent))  # fmt: skip
    secret = docs[("Secret", volumes[mount["name"]]["secret"]["secretName"])]["stringData"]
    (tmp_path / in_pod.name).write_text(secret[in_pod.name])
    env["LLM_STREAMS_LLM__API_KEY_FILE"] = str(tmp_path / in_pod.name)
    settings = _settings_from(env, monkeypatch)
    assert settings.llm.api_key.get_secret_value() == secret[in_pod.name]
    return settings.model_copy(update={"llm": settings.llm.model_copy(
        update={"api_key_file": in_pod})})  # fmt: skip


def test_the_chart_lints_strictly_and_its_generated_files_are_up_to_date() -> None:
    out = helm("lint", "--strict", str(CHART))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 chart(s) failed" in out.stdout
    spec = importlib.util.spec_from_file_location("render", CHART.parent / "render.py")
    assert spec is not None and spec.loader is not None
    render_py = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render_py)
    made = render_py.rendered()
    assert "files/pipelines/comment-analysis.yaml" in made and "values.schema.json" in made
    for name, text in made.items():
        assert (CHART / name).read_text() == text, "run: python deploy/helm/render.py"
    for folder in render_py.COPIED:  # no stale copy of a file removed at its source
        on_disk = {f"{folder}/{p.name}" for p in (CHART / folder).iterdir()}
        assert on_disk <= set(made), on_disk - set(made)


def test_the_rendered_manifests_validate_against_the_kubernetes_schemas(
    docs: dict[tuple[str, str], dict[str, Any]],
) -> None:
    import kubernetes_validate

    kinds = {kind for kind, _ in docs}
    assert kinds >= {"StatefulSet", "Service", "PodDisruptionBudget", "ConfigMap", "Secret",
                     "ScaledObject", "TriggerAuthentication", "ServiceMonitor",
                     "PrometheusRule"}  # fmt: skip
    checked = 0
    for doc in docs.values():
        if doc["apiVersion"].startswith(("keda.sh/", "monitoring.coreos.com/")):
            continue  # CRDs: their fields are checked against the rest in the tests below
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
        checked += 1
    assert checked >= 8
    wrong = copy.deepcopy(docs[("StatefulSet", f"{RELEASE}-worker")])
    wrong["spec"]["replica"] = 3  # a typo must fail the check
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, KUBERNETES, strict=True)


def test_the_values_schema_refuses_a_misspelt_setting_and_a_secret_given_as_a_setting() -> None:
    assert "partitons" in refused("settings.kafka.partitons=3")
    assert "partitions" in refused("settings.kafka.partitions=many")
    assert "api_key" in refused("settings.llm.api_key=sk-live")
    assert "sasl_password" in refused("settings.kafka.security.sasl_password=hunter2")
    assert "replica" in refused("replica=3")  # the chart's own values too


def test_the_pods_run_with_settings_the_worker_reads_and_probe_its_own_health(
    docs: dict[tuple[str, str], dict[str, Any]], monkeypatch: Any, tmp_path: Path,
) -> None:  # fmt: skip
    settings = settings_of(docs, monkeypatch, tmp_path)
    statefulset = docs[("StatefulSet", f"{RELEASE}-worker")]
    pod = statefulset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "llm-streams:0.1.0"  # the chart's appVersion
    assert container["envFrom"] == [{"configMapRef": {"name": f"{RELEASE}-settings"}}]
    assert container["ports"][0]["containerPort"] == settings.web_port
    assert settings.web_bind == "0.0.0.0"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts[str(settings.data_dir)] == "data"  # the claim of volumeClaimTemplates
    assert {t["metadata"]["name"] for t in statefulset["spec"]["volumeClaimTemplates"]} == {"data"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    pipelines = docs[
        ("ConfigMap", volumes[mounts[str(settings.pipelines_dir)]]["configMap"]["name"])
    ]
    assert set(pipelines["data"]) == {p.name for p in (ROOT / "pipelines").glob("*.yaml")}
    schemas = docs[("ConfigMap", volumes[mounts[str(settings.schemas_dir)]]["configMap"]["name"])]
    assert set(schemas["data"]) == {p.name for p in (ROOT / "schemas").glob("*.json")}
    # The worker's own probes (observability.health), not a page that answers regardless.
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert "127.0.0.1:6066/healthz" in (ROOT / "deploy" / "Dockerfile").read_text()
    assert settings.shutdown_grace_s < pod["terminationGracePeriodSeconds"]
    service = docs[("Service", f"{RELEASE}-worker")]
    assert service["spec"]["selector"].items() <= pod_labels(statefulset).items()
    assert statefulset["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    # Scaled by KEDA: the StatefulSet leaves its replica count to it.
    assert "replicas" not in statefulset["spec"]
    # The readiness says an LLM outage (breakers open): every worker is unready then, and a
    # budget counting them as disrupted let no node drain through until the outage ended.
    budget = docs[("PodDisruptionBudget", f"{RELEASE}-worker")]["spec"]
    assert budget["selector"]["matchLabels"].items() <= pod_labels(statefulset).items()
    assert budget["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def pod_labels(statefulset: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = statefulset["spec"]["template"]["metadata"]["labels"]
    return labels


def test_every_secret_a_setting_names_is_a_file_the_pod_mounts(
    docs: dict[tuple[str, str], dict[str, Any]], monkeypatch: Any, tmp_path: Path,
) -> None:  # fmt: skip
    settings = settings_of(docs, monkeypatch, tmp_path)
    sec = settings.kafka.security
    assert (sec.protocol, sec.sasl_mechanism) == ("SASL_SSL", "SCRAM-SHA-512")
    pod = docs[("StatefulSet", f"{RELEASE}-worker")]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    by_path = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]
               if m["name"] in volumes}  # fmt: skip
    for path in (settings.llm.api_key_file, sec.ssl_cafile, sec.sasl_username_file,
                 sec.sasl_password_file):  # fmt: skip
        assert path is not None
        volume = by_path[str(path.parent)]
        assert volume["secret"]["defaultMode"] == 0o400
        secret = docs[("Secret", volume["secret"]["secretName"])]
        assert path.name in secret["stringData"], path
    # None of the secrets is in the settings ConfigMap.
    data = docs[("ConfigMap", f"{RELEASE}-settings")]["data"]
    assert "replace-me" not in json.dumps(data)


def test_a_release_that_could_not_work_is_refused_with_what_to_change(tmp_path: Path) -> None:
    said = refused("settings.shutdown_grace_s=90")
    assert "shutdown_grace_s (90) must be below terminationGracePeriodSeconds (60)" in said
    said = refused("settings.llm.api_key_file=/etc/keys/openai")
    assert "settings.llm.api_key_file is /etc/keys/openai" in said and "/etc/keys" in said
    assert "above settings.kafka.partitions (12)" in refused("autoscaling.maxReplicas=20")
    plain = {"deployments": {"deployments": [{"name": "a", "model": "m", "base_url": "http://x/v1",
                                               "api_key_env": "KEY_A"}]}}  # fmt: skip
    assert "api_key_file" in refused(values=plain, tmp_path=tmp_path)


def test_keda_reads_the_lag_the_worker_makes_with_the_workers_credentials(
    docs: dict[tuple[str, str], dict[str, Any]], monkeypatch: Any, tmp_path: Path,
) -> None:  # fmt: skip
    settings = settings_of(docs, monkeypatch, tmp_path)
    scaled = docs[("ScaledObject", f"{RELEASE}-worker")]
    assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet",
                                               "name": f"{RELEASE}-worker"}  # fmt: skip
    assert scaled["spec"]["maxReplicaCount"] <= settings.kafka.partitions
    (trigger,) = scaled["spec"]["triggers"]
    meta = trigger["metadata"]
    assert meta["consumerGroup"] == settings.app_id and meta["topic"] == settings.topics.tasks
    assert meta["bootstrapServers"] == settings.bootstrap_servers
    security = settings.kafka.security
    assert meta["sasl"] == "scram_sha512" and meta["tls"] == "enable"
    auth = docs[("TriggerAuthentication", trigger["authenticationRef"]["name"])]
    refs = {r["parameter"]: (r["name"], r["key"]) for r in auth["spec"]["secretTargetRef"]}
    assert set(refs) == {"username", "password", "ca"}
    for parameter, path in (("username", security.sasl_username_file),
                            ("password", security.sasl_password_file),
                            ("ca", security.ssl_cafile)):  # fmt: skip
        name, key = refs[parameter]
        assert path is not None and key == path.name
        assert key in docs[("Secret", name)]["stringData"]


def test_a_plaintext_cluster_needs_no_trigger_authentication() -> None:
    docs = render(None, None, "settings.kafka.security.protocol=PLAINTEXT",
                  "settings.kafka.security.sasl_mechanism=null",
                  "settings.kafka.security.ssl_cafile=null",
                  "settings.kafka.security.sasl_username_file=null",
                  "settings.kafka.security.sasl_password_file=null",
                  "settings.kafka.broker_url=kafka://k1:9092;k2:9092")  # fmt: skip
    (trigger,) = docs[("ScaledObject", f"{RELEASE}-worker")]["spec"]["triggers"]
    assert trigger["metadata"]["tls"] == "disable" and "sasl" not in trigger["metadata"]
    assert trigger["metadata"]["bootstrapServers"] == "k1:9092,k2:9092"
    assert "authenticationRef" not in trigger
    assert not any(kind == "TriggerAuthentication" for kind, _ in docs)
    settings = docs[("ConfigMap", f"{RELEASE}-settings")]["data"]
    assert "LLM_STREAMS_KAFKA__SECURITY__SSL_CAFILE" not in settings  # null: left to the default


def test_a_changed_pipeline_or_secret_rolls_the_pods_and_own_configmaps_are_mounted(
    docs: dict[tuple[str, str], dict[str, Any]], tmp_path: Path,
) -> None:  # fmt: skip
    def annotations(d: dict[tuple[str, str], dict[str, Any]]) -> dict[str, str]:
        out: dict[str, str] = d[("StatefulSet", f"{RELEASE}-worker")]["spec"]["template"][
            "metadata"]["annotations"]  # fmt: skip
        return out

    before = annotations(docs)
    text = (ROOT / "pipelines" / "comment-analysis.yaml").read_text() + "\n# a new prompt\n"
    changed = render(tmp_path, {"pipelines": {"files": {"comment-analysis.yaml": text}}})
    assert changed[("ConfigMap", f"{RELEASE}-pipelines")]["data"] == {
        "comment-analysis.yaml": text}  # fmt: skip
    assert annotations(changed)["checksum/config"] != before["checksum/config"]
    assert annotations(changed)["checksum/secrets"] == before["checksum/secrets"]
    rotated = render(None, None, "secretFiles.llm.files.api-key=sk-new")
    assert annotations(rotated)["checksum/secrets"] != before["checksum/secrets"]
    # A Secret and ConfigMaps of the user's: mounted, not made.
    own = render(None, None, "secretFiles.kafka.existingSecret=shop-kafka-user",
                 "pipelines.existingConfigMap=shop-pipelines")  # fmt: skip
    assert ("Secret", f"{RELEASE}-kafka") not in own
    assert ("ConfigMap", f"{RELEASE}-pipelines") not in own
    pod = own[("StatefulSet", f"{RELEASE}-worker")]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["secret-kafka"]["secret"]["secretName"] == "shop-kafka-user"
    assert volumes["pipelines"]["configMap"]["name"] == "shop-pipelines"
    auth = own[("TriggerAuthentication", f"{RELEASE}-worker-kafka")]
    assert {r["name"] for r in auth["spec"]["secretTargetRef"]} == {"shop-kafka-user"}


def test_a_deployments_file_is_mounted_named_and_reads_as_the_worker_reads_it(
    tmp_path: Path, monkeypatch: Any,
) -> None:  # fmt: skip
    declared = {"deployments": [
        {"name": "openai-a", "model": "gpt-4o-mini", "base_url": "https://api.openai.com/v1",
         "api_key_file": "/etc/llm-streams/llm/key-a", "rpm": 500},
        {"name": "azure-we", "model": "gpt-4o-mini", "auth": "azure",
         "base_url": "https://r.openai.azure.com", "provider_model": "prod",
         "api_version": "2024-10-21", "api_key_file": "/etc/llm-streams/llm/key-b"},
    ]}  # fmt: skip
    keys = {"key-a": "sk-a", "key-b": "az-b"}
    docs = render(tmp_path, {"deployments": declared,
                             "secretFiles": {"llm": {"mountPath": "/etc/llm-streams/llm",
                                                     "files": {"api-key": "sk", **keys}}}})  # fmt: skip
    settings = settings_of(docs, monkeypatch, tmp_path)
    assert settings.llm.deployments_file == Path("/etc/llm-streams/deployments/deployments.yaml")
    pod = docs[("StatefulSet", f"{RELEASE}-worker")]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    folder = str(settings.llm.deployments_file.parent)
    mounted = docs[("ConfigMap", volumes[mounts[folder]]["configMap"]["name"])]["data"]
    # The file as the pod sees it, its keys as the llm Secret's files: the worker's loader.
    (tmp_path / "deployments.yaml").write_text(mounted["deployments.yaml"])
    (tmp_path / "keys").mkdir()
    for name, key in docs[("Secret", f"{RELEASE}-llm")]["stringData"].items():
        (tmp_path / "keys" / name).write_text(key)
    text = mounted["deployments.yaml"].replace("/etc/llm-streams/llm/", f"{tmp_path}/keys/")
    (tmp_path / "deployments.yaml").write_text(text)
    loaded = load_deployments(tmp_path / "deployments.yaml")
    assert [(d.spec.name, d.api_key) for d in loaded] == [
        ("openai-a", "sk-a"),
        ("azure-we", "az-b"),
    ]
    # A key file outside every mounted secret is refused before any pod starts.
    declared["deployments"][0]["api_key_file"] = "/run/keys/a"
    said = refused(values={"deployments": declared}, tmp_path=tmp_path)
    assert "openai-a: api_key_file is /run/keys/a" in said


def test_the_monitoring_carries_the_rules_with_runbooks_and_the_dashboard(
    docs: dict[tuple[str, str], dict[str, Any]],
) -> None:
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "rules.yml").read_text())
    rule = docs[("PrometheusRule", RELEASE)]
    assert rule["spec"]["groups"] == rules["groups"]
    board = docs[("ConfigMap", f"{RELEASE}-grafana-dashboard")]
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"  # the sidecar's label
    shipped = json.loads((ROOT / "deploy/grafana/dashboards/llm-streams.json").read_text())
    assert json.loads(board["data"]["llm-streams.json"]) == shipped
    monitor = docs[("ServiceMonitor", f"{RELEASE}-worker")]
    service = docs[("Service", f"{RELEASE}-worker")]
    assert monitor["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    # Each alert's runbook under the team's docs address.
    base = "https://git.example.com/shop/llm-streams/-/blob/main/docs/OPERATIONS.md"
    linked = render(None, None, f"monitoring.prometheusRule.runbookBase={base}")
    alerts = [r for g in linked[("PrometheusRule", RELEASE)]["spec"]["groups"]
              for r in g["rules"] if "alert" in r]  # fmt: skip
    assert alerts and all(a["annotations"]["runbook_url"] == f"{base}#{a['alert'].lower()}"
                          for a in alerts)  # fmt: skip
    off = render(None, None, "autoscaling.enabled=false", "replicas=2",
                 "monitoring.serviceMonitor.enabled=false",
                 "monitoring.prometheusRule.enabled=false",
                 "monitoring.grafanaDashboard.enabled=false")  # fmt: skip
    assert not {"ScaledObject", "ServiceMonitor", "PrometheusRule"} & {k for k, _ in off}
    assert off[("StatefulSet", f"{RELEASE}-worker")]["spec"]["replicas"] == 2


def test_the_values_docs_deploy_shows_render(tmp_path: Path) -> None:
    """docs/DEPLOY.md's values files, as printed there, pass the schema and the chart's
    checks, and give the pods the settings they say."""
    import re

    page = (ROOT / "docs" / "DEPLOY.md").read_text()
    shop, several = (yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", page, re.S))
    docs = render(tmp_path, shop)
    pod = docs[("StatefulSet", f"{RELEASE}-worker")]["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == "registry.example.com/shop/llm-streams:0.1.0"
    volumes = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    assert volumes == {"secret-llm": "llm-key", "secret-kafka": "kafka-user"}
    assert not any(kind == "Secret" for kind, _ in docs)  # both are the user's
    data = docs[("ConfigMap", f"{RELEASE}-settings")]["data"]
    assert data["LLM_STREAMS_LLM__MODEL"] == "gpt-4o-mini"
    with_deployments = render(tmp_path, {**shop, **several})
    data = with_deployments[("ConfigMap", f"{RELEASE}-settings")]["data"]
    assert data["LLM_STREAMS_LLM__DEPLOYMENTS_FILE"].endswith("/deployments.yaml")
