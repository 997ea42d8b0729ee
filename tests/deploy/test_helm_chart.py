"""The Helm chart under deploy/helm/cachet, rendered by Helm's own engine (helm-python-sdk binds
Helm's Go SDK; no helm binary, no cluster) with the default and the GPU values, every manifest
validated against the Kubernetes API schemas (kubernetes-validate, offline, strict: an unknown
field fails), and what the services need checked in what was rendered."""

from __future__ import annotations

import json
import re
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from cachet.grpc_channel import spreads_calls
from cachet.tools.cli import SERVICES

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "cachet"
GPU_VALUES = yaml.safe_load((CHART / "values-gpu.yaml").read_text())
# The oldest Kubernetes the chart claims (Chart.yaml kubeVersion: gRPC probes are GA from 1.27)
# and the newest the validator knows.
KUBERNETES_VERSIONS = ["1.27.0", kubernetes_validate.latest_version()]
STORE = {"store": {"url": "postgresql://cachet@db:5432/cachet"}}
TLS = {"tls": {"secretName": "cachet-tls", "clientAuth": True}}


def render(values: dict | None = None) -> list[dict]:
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values or {}, name="cachet", namespace="ai")
    return [doc for text in manifests.values() for doc in yaml.safe_load_all(text) if doc]


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def container(workload: dict) -> dict:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


def env(workload: dict) -> dict[str, object]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container(workload)["env"]}


@pytest.fixture(scope="module", params=["default", "gpu", "store", "gpu-routers"])
def docs(request: pytest.FixtureRequest) -> list[dict]:
    values = {
        "default": {},
        "gpu": GPU_VALUES,
        "store": {**STORE, "router": {"replicas": 3}},
        "gpu-routers": {**GPU_VALUES, **STORE, "router": {"replicas": 2}},
    }
    return render(values[request.param])


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_validates_against_the_kubernetes_schemas(docs: list[dict], version: str) -> None:
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_chart_lints_clean() -> None:
    assert helm.lint(str(CHART))["errors"] == []


def test_services_are_deployments_and_engines_a_statefulset_each_with_a_budget(docs: list[dict]) -> None:
    deployments = by_kind(docs, "Deployment")
    assert set(deployments) == {
        f"cachet-{name}" for name in ("tokenizer", "router", "cache", "usage", "bridge")
    }
    assert set(by_kind(docs, "StatefulSet")) == {"cachet-engine"}
    workloads = {**deployments, **by_kind(docs, "StatefulSet")}
    assert set(by_kind(docs, "PodDisruptionBudget")) == set(workloads)
    # Several routers add a headless Service naming each one, for the bridge (below).
    several_routers = deployments["cachet-router"]["spec"]["replicas"] > 1
    assert set(by_kind(docs, "Service")) == set(workloads) | (
        {"cachet-router-headless"} if several_routers else set()
    )
    assert by_kind(docs, "Service")["cachet-engine"]["spec"]["clusterIP"] == "None"


def test_each_container_runs_a_cachet_command_as_a_non_root_user(docs: list[dict]) -> None:
    workloads = {**by_kind(docs, "Deployment"), **by_kind(docs, "StatefulSet")}
    for name, workload in workloads.items():
        service = name.removeprefix("cachet-")
        assert container(workload)["args"] == ["serve", service]
        assert service in SERVICES
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0


def test_termination_outlasts_the_drain_and_liveness_tolerates_it(docs: list[dict]) -> None:
    workloads = {**by_kind(docs, "Deployment"), **by_kind(docs, "StatefulSet")}
    for name, workload in workloads.items():
        service = name.removeprefix("cachet-").upper()
        drain = int(env(workload)[f"CACHET_{service}_DRAIN_SECONDS"])
        assert workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain
        liveness = container(workload)["livenessProbe"]
        assert liveness["periodSeconds"] * liveness["failureThreshold"] > drain, name


def test_probes_are_grpc_health_and_the_bridges_health_and_ready(docs: list[dict]) -> None:
    workloads = {**by_kind(docs, "Deployment"), **by_kind(docs, "StatefulSet")}
    for name, workload in workloads.items():
        probes = container(workload)
        if name == "cachet-bridge":
            assert probes["livenessProbe"]["httpGet"]["path"] == "/health"
            assert probes["readinessProbe"]["httpGet"]["path"] == "/ready"
            continue
        port = int(env(workload)[f"CACHET_{name.removeprefix('cachet-').upper()}_PORT"])
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert probes[probe]["grpc"]["port"] == port


def test_services_find_each_other_and_every_engine_replica(docs: list[dict]) -> None:
    deployments = by_kind(docs, "Deployment")
    engines = by_kind(docs, "StatefulSet")["cachet-engine"]
    replicas = engines["spec"]["replicas"]
    expected = [f"cachet-engine-{i}.cachet-engine.ai.svc.cluster.local:50061" for i in range(replicas)]
    assert json.loads(env(deployments["cachet-router"])["CACHET_ROUTER_ENGINE_ADDRESSES"]) == expected
    assert json.loads(env(deployments["cachet-cache"])["CACHET_CACHE_ENGINE_ADDRESSES"]) == expected
    services = {name: doc["spec"]["ports"][0]["port"] for name, doc in by_kind(docs, "Service").items()}
    router_env = env(deployments["cachet-router"])
    for variable, service in [
        ("CACHET_ROUTER_TOKENIZER_ADDRESS", "cachet-tokenizer"),
        ("CACHET_ROUTER_CACHE_ADDRESS", "cachet-cache"),
        ("CACHET_ROUTER_USAGE_ADDRESS", "cachet-usage"),
    ]:
        assert router_env[variable] == f"{service}:{services[service]}"
    # One router: its Service. Several: every router pod through the headless Service, which
    # the bridge's channel spreads calls over (a ClusterIP would hold its one connection on one).
    routers = deployments["cachet-router"]["spec"]["replicas"]
    assert env(deployments["cachet-bridge"])["CACHET_BRIDGE_ROUTER_ADDRESS"] == (
        f"dns:///cachet-router-headless.ai.svc.cluster.local:{services['cachet-router']}"
        if routers > 1
        else f"cachet-router:{services['cachet-router']}"
    )
    if routers > 1:
        headless = by_kind(docs, "Service")["cachet-router-headless"]["spec"]
        assert headless["clusterIP"] == "None"
        assert headless["selector"] == deployments["cachet-router"]["spec"]["selector"]["matchLabels"]
        assert spreads_calls(env(deployments["cachet-bridge"])["CACHET_BRIDGE_ROUTER_ADDRESS"])
    # The bridge refuses to listen beyond loopback without API keys: they come from a Secret.
    for name in ("cachet-bridge", "cachet-router"):
        assert env(deployments[name])["CACHET_API_KEYS"]["secretKeyRef"]["name"] == "cachet-api-keys"


def test_metrics_are_annotated_where_each_service_serves_them(docs: list[dict]) -> None:
    workloads = {**by_kind(docs, "Deployment"), **by_kind(docs, "StatefulSet")}
    for name, workload in workloads.items():
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        service = name.removeprefix("cachet-").upper()
        served = env(workload).get(f"CACHET_{service}_METRICS_PORT") or env(workload).get("CACHET_PORT")
        assert annotations["prometheus.io/port"] == served


def test_gpu_values_put_engines_on_gpus_with_the_cuda_image() -> None:
    engine = by_kind(render(GPU_VALUES), "StatefulSet")["cachet-engine"]
    assert container(engine)["image"].endswith(":cuda")
    assert container(engine)["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert env(engine)["CACHET_DEVICE"] == "cuda"
    assert engine["spec"]["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert "CACHET_KV_CACHE_GB" not in env(engine)  # sized from the GPU's own memory
    # The CPU default asks for no GPU, and sizes threads and KV itself (a container sees every
    # core and all the memory of its node).
    default = by_kind(render(), "StatefulSet")["cachet-engine"]
    assert "nvidia.com/gpu" not in container(default)["resources"].get("limits", {})
    assert (env(default)["CACHET_ENGINE_THREADS"], env(default)["CACHET_KV_CACHE_GB"]) == ("2", "4")


def test_postgresql_comes_by_url_and_several_routers_need_it() -> None:
    deployments = by_kind(render({**STORE, "router": {"replicas": 3}}), "Deployment")
    assert deployments["cachet-router"]["spec"]["replicas"] == 3
    for name in ("cachet-router", "cachet-usage"):
        assert env(deployments[name])["CACHET_STORE_URL"] == STORE["store"]["url"]
    secret = render({"store": {"existingSecret": "db", "secretKey": "dsn"}})
    usage = by_kind(secret, "Deployment")["cachet-usage"]
    assert env(usage)["CACHET_STORE_URL"] == {"secretKeyRef": {"name": "db", "key": "dsn"}}
    # Without a store, SQLite files would keep each router's queue apart: refused, with the fix.
    with pytest.raises(Exception, match=r"router.replicas > 1 needs store.existingSecret or store.url"):
        render({"router": {"replicas": 2}})
    with pytest.raises(Exception, match="needs store"):
        render({**GPU_VALUES, "router": {"replicas": 2}})


def test_operator_accounts_reach_the_routers() -> None:
    assert "CACHET_ROUTER_OPERATOR_ACCOUNTS" not in env(by_kind(render(), "Deployment")["cachet-router"])
    router = by_kind(render({"auth": {"operatorAccounts": ["ops", "sre"]}}), "Deployment")["cachet-router"]
    assert json.loads(env(router)["CACHET_ROUTER_OPERATOR_ACCOUNTS"]) == ["ops", "sre"]


def test_a_model_claim_is_mounted_read_only_for_the_engines_and_the_tokenizer() -> None:
    docs = render({"model": {"claim": "models", "name": "/models/kimi-k2.5"}})
    workloads = {**by_kind(docs, "Deployment"), **by_kind(docs, "StatefulSet")}
    for name in ("cachet-engine", "cachet-tokenizer"):
        assert env(workloads[name])["CACHET_MODEL"] == "/models/kimi-k2.5"
        mounts = {m["name"]: m for m in container(workloads[name])["volumeMounts"]}
        assert mounts["models"] == {"name": "models", "mountPath": "/models", "readOnly": True}


SCRAPE_JOBS = yaml.safe_load((ROOT / "deploy" / "prometheus" / "scrape-config.yaml").read_text())[
    "scrape_configs"
]


def test_the_scrape_config_keeps_what_the_chart_annotates() -> None:
    assert [job["job_name"] for job in SCRAPE_JOBS] == ["cachet", "cachet-tls"]
    for job in SCRAPE_JOBS:
        sources = {label for rule in job["relabel_configs"] for label in rule["source_labels"]}
        for annotation in ("scrape", "port", "path", "scheme"):
            assert f"__meta_kubernetes_pod_annotation_prometheus_io_{annotation}" in sources


def scraped_by(workload: dict) -> list[dict]:
    """The scrape jobs whose keep rules keep this workload's pods (Prometheus's relabelling: each
    rule's source labels joined by ';', the regex anchored at both ends, absent labels empty)."""
    template = workload["spec"]["template"]["metadata"]
    meta = {
        f"__meta_kubernetes_pod_label_{name.replace('.', '_').replace('/', '_').replace('-', '_')}": value
        for name, value in template["labels"].items()
    } | {
        f"__meta_kubernetes_pod_annotation_{name.replace('.', '_').replace('/', '_')}": value
        for name, value in template["annotations"].items()
    }
    return [
        job
        for job in SCRAPE_JOBS
        if all(
            re.fullmatch(rule["regex"], ";".join(meta.get(label, "") for label in rule["source_labels"]))
            for rule in job["relabel_configs"]
            if rule.get("action") == "keep"
        )
    ]


@pytest.mark.parametrize("values", [{}, TLS], ids=["plaintext", "tls"])
def test_each_pod_is_scraped_by_one_job_over_https_with_the_cas_client_certificate_under_tls(
    values: dict,
) -> None:
    docs = render(values)
    workloads = {**by_kind(docs, "Deployment"), **by_kind(docs, "StatefulSet")}
    assert len(workloads) == 6
    for name, workload in workloads.items():
        (job,) = scraped_by(workload)
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        if values:
            assert annotations["prometheus.io/scheme"] == job["scheme"] == "https", name
            # Prometheus verifies the pods with the CA under the one name their certificate
            # shares, and presents its own pair: gRPC services' /metrics ask for it under clientAuth.
            assert set(job["tls_config"]) == {"ca_file", "cert_file", "key_file", "server_name"}
            assert job["tls_config"]["server_name"] == "cachet-router"
        else:
            assert annotations["prometheus.io/scheme"] == job["scheme"] == "http", name
            assert "tls_config" not in job


def test_a_replica_across_hosts_is_a_leaderworkerset_group_under_torchrun() -> None:
    """LeaderWorkerSet is a custom resource the validator has no schema for: its two pod
    templates are validated as Kubernetes PodTemplates, its own fields checked here."""
    values = {
        **GPU_VALUES,
        "engine": {**GPU_VALUES["engine"], "gpus": 8, "multiHost": {"nodes": 2, "ranksPerNode": 8}},
    }
    docs = render(values)
    assert "StatefulSet" not in {doc["kind"] for doc in docs}
    # LeaderWorkerSet makes the headless Service of the leaders (<name>), so the chart does not.
    assert "cachet-engine" not in by_kind(docs, "Service")
    (group,) = [doc for doc in docs if doc["kind"] == "LeaderWorkerSet"]
    assert group["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    spec = group["spec"]
    assert (spec["replicas"], spec["leaderWorkerTemplate"]["size"]) == (2, 2)
    templates = {role: spec["leaderWorkerTemplate"][f"{role}Template"] for role in ("leader", "worker")}
    for version in KUBERNETES_VERSIONS:
        for template in templates.values():
            kubernetes_validate.validate(
                {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template},
                version,
                strict=True,
            )
    leader, worker = (only for template in templates.values() for only in template["spec"]["containers"])
    for pod in (leader, worker):
        assert pod["command"][0] == "torchrun" and pod["command"][-2:] == ["-m", "cachet.engine"]
        assert "--nproc-per-node=8" in pod["command"]
        assert "--master-addr=$(LWS_LEADER_ADDRESS)" in pod["command"]
        assert {e["name"]: e["value"] for e in pod["env"] if "value" in e}["CACHET_TP"] == "16"
        assert pod["resources"]["limits"]["nvidia.com/gpu"] == 8
    # Rank 0, on the leader, serves gRPC: probes and ports there only.
    assert leader["readinessProbe"]["grpc"]["port"] == 50061 and "ports" in leader
    assert "readinessProbe" not in worker and "ports" not in worker
    # The router follows each group's leader, by the name it has as a StatefulSet pod would.
    router = by_kind(docs, "Deployment")["cachet-router"]
    assert json.loads(env(router)["CACHET_ROUTER_ENGINE_ADDRESSES"]) == [
        f"cachet-engine-{i}.cachet-engine.ai.svc.cluster.local:50061" for i in range(2)
    ]


def test_without_a_tls_secret_plaintext_between_pods_is_chosen_explicitly(docs: list[dict]) -> None:
    workloads = {**by_kind(docs, "Deployment"), **by_kind(docs, "StatefulSet")}
    for workload in workloads.values():
        variables = env(workload)
        assert variables["CACHET_TLS_ALLOW_PLAINTEXT"] == "true"
        assert "CACHET_TLS_CERT_FILE" not in variables


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_a_tls_secret_is_mounted_and_every_service_serves_and_calls_with_it(version: str) -> None:
    docs = render(TLS)
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
    workloads = {**by_kind(docs, "Deployment"), **by_kind(docs, "StatefulSet")}
    assert len(workloads) == 6
    for name, workload in workloads.items():
        variables = env(workload)
        assert variables["CACHET_TLS_CERT_FILE"] == "/etc/cachet/tls/tls.crt"
        assert variables["CACHET_TLS_KEY_FILE"] == "/etc/cachet/tls/tls.key"
        assert variables["CACHET_TLS_CA_FILE"] == "/etc/cachet/tls/ca.crt"
        assert "CACHET_TLS_ALLOW_PLAINTEXT" not in variables
        # Mutual TLS between services; the public REST port asks no certificate.
        assert variables.get("CACHET_TLS_CLIENT_AUTH") == (None if name == "cachet-bridge" else "true")
        pod = workload["spec"]["template"]["spec"]
        assert {"name": "tls", "secret": {"secretName": "cachet-tls"}} in pod["volumes"]
        mount = {"name": "tls", "mountPath": "/etc/cachet/tls", "readOnly": True}
        assert mount in container(workload)["volumeMounts"]
        probes = container(workload)
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            if name == "cachet-bridge":
                assert probes[probe]["httpGet"]["scheme"] == "HTTPS"
            else:
                # The kubelet's gRPC probe cannot speak TLS.
                assert "grpc" not in probes[probe] and "tcpSocket" in probes[probe]
