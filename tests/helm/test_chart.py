"""Offline tests of the helm/bubblespec chart.

Lint, render several value sets, validate every object against the Kubernetes OpenAPI schemas
(kubernetes-validate, newest version it ships), and check the properties the chart promises:
security posture, probes, GPU resources, Redis wiring, NetworkPolicy reachability, values
schema and values documentation.
"""

from __future__ import annotations

import base64
import copy
import json
import re
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest
import yaml

from helm_support import CHART_DIR, NAMESPACE, RELEASE, VALUE_SETS, Rendered, parse

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="needs: pip install kubernetes-validate")
jsonschema = pytest.importorskip("jsonschema")
helm_python = pytest.importorskip("helm_python", reason="needs: pip install helm-python-sdk")

from kubernetes_validate.utils import latest_version  # noqa: E402

K8S_VERSION = latest_version()
FULLNAME = f"{RELEASE}-bubblespec"
SCHEDULER_ADDRESS = f"{FULLNAME}-scheduler.{NAMESPACE}.svc:50051"
# Custom resources: no schema in kubernetes-validate; checked by hand below.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
POD_OWNERS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}


# --------------------------------------------------------------------------- helpers


def pod_specs(rendered: Rendered) -> Iterator[tuple[str, dict[str, Any]]]:
    for m in rendered.manifests:
        if m.kind in POD_OWNERS:
            yield f"{m.kind}/{m.name}", m.obj["spec"]["template"]["spec"]
        elif m.kind == "Pod":
            yield f"Pod/{m.name}", m.obj["spec"]


def all_containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return list(spec.get("initContainers", [])) + list(spec["containers"])


def container(obj: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in obj["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def env_of(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in c.get("env", [])}


def port_number(c: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in c["ports"] if p["name"] == port)


def worker(rendered: Rendered) -> dict[str, Any]:
    return rendered.one("StatefulSet", "-worker")


def scheduler(rendered: Rendered) -> dict[str, Any]:
    return rendered.one("Deployment", "-scheduler")


def selector_labels(component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "bubblespec",
        "app.kubernetes.io/instance": RELEASE,
        "app.kubernetes.io/component": component,
    }


# --------------------------------------------------------------------------- chart level


def test_chart_metadata(chart) -> None:
    meta = chart.metadata
    assert meta["apiVersion"] == "v2"
    assert meta["name"] == "bubblespec"
    assert meta["appVersion"] == "0.1.0"


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_lint_is_clean(value_set: str) -> None:
    report = helm_python.lint(CHART_DIR, VALUE_SETS[value_set], strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    # Severity 2 = warning, 3 = error; info (such as "icon is recommended") is fine.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_helpers_are_namespaced() -> None:
    text = (CHART_DIR / "templates" / "_helpers.tpl").read_text()
    defined = re.findall(r'define\s+"([^"]+)"', text)
    assert defined
    assert [d for d in defined if not d.startswith("bubblespec.")] == []
    for tpl in (CHART_DIR / "templates").rglob("*"):
        if tpl.is_file():
            for used in re.findall(r'(?:include|template)\s+"([^"]+)"', tpl.read_text()):
                assert used in defined, f"{tpl.name} uses undefined helper {used}"


def test_one_resource_per_template(render) -> None:
    # Render with every optional resource on, then count objects per template file.
    everything = VALUE_SETS["many-workers"]
    rendered = render(everything)
    per_file: dict[str, list[str]] = {}
    for m in rendered.manifests:
        per_file.setdefault(m.template, []).append(m.kind)
    assert all(len(kinds) == 1 for kinds in per_file.values()), per_file
    templates = {p.name for p in (CHART_DIR / "templates").rglob("*.yaml")}
    assert {Path(t).name for t in per_file} == templates


# --------------------------------------------------------------------------- manifests


def test_every_manifest_validates_against_kubernetes(rendered: Rendered) -> None:
    assert rendered.manifests
    for m in rendered.manifests:
        key = (m.obj["apiVersion"], m.kind)
        if key in CRD_KINDS:
            continue  # checked in test_service_monitors
        try:
            kubernetes_validate.validate(m.obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = f"{m.template}: {m.kind}/{m.name}"
            pytest.fail(f"{where} invalid for Kubernetes {K8S_VERSION}: {exc.message} at {list(exc.path)}")


def test_kubernetes_validation_is_strict(render) -> None:
    # The check above must not pass vacuously: an unknown field in a container is refused.
    deployment = copy.deepcopy(scheduler(render({})))
    deployment["spec"]["template"]["spec"]["containers"][0]["gpus"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_every_object_is_labelled_and_namespaced(rendered: Rendered) -> None:
    for m in rendered.manifests:
        meta = m.obj["metadata"]
        assert meta["namespace"] == NAMESPACE, m.name
        assert meta["labels"]["app.kubernetes.io/instance"] == RELEASE
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "Helm"
        assert len(m.name) <= 63


def test_security_posture_of_every_pod(rendered: Rendered) -> None:
    specs = list(pod_specs(rendered))
    assert specs
    for where, spec in specs:
        psc = spec["securityContext"]
        assert psc["runAsNonRoot"] is True, where
        assert psc["runAsUser"] == 1000, where
        assert psc["seccompProfile"]["type"] == "RuntimeDefault", where
        assert spec["automountServiceAccountToken"] is False, where
        assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC"), where
        for c in all_containers(spec):
            at = f"{where} container {c['name']}"
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] is True, at
            assert sc["allowPrivilegeEscalation"] is False, at
            assert sc["capabilities"]["drop"] == ["ALL"], at
            assert not sc["capabilities"].get("add"), at
            assert sc["readOnlyRootFilesystem"] is True, at
            assert sc.get("privileged", False) is False, at
            assert sc["seccompProfile"]["type"] == "RuntimeDefault", at
            for section in ("requests", "limits"):
                for resource in ("cpu", "memory"):
                    assert c["resources"][section][resource], f"{at}: no {section}.{resource}"


RESTRICTED_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                           "persistentVolumeClaim", "projected", "secret"}


def test_pods_fit_the_restricted_pod_security_standard(rendered: Rendered, value_set: str) -> None:
    # Pod Security Admission "restricted" allows only these volume types; a hostPath model
    # volume (opt-in) needs a namespace labelled privileged, as docs/DEPLOY.md says.
    uses_host_path = bool(VALUE_SETS[value_set].get("model", {}).get("hostPath", {}).get("path"))
    for where, spec in pod_specs(rendered):
        for volume in spec.get("volumes", []):
            kind = next(k for k in volume if k != "name")
            if kind == "hostPath":
                assert uses_host_path and volume["name"] == "model", where
            else:
                assert kind in RESTRICTED_VOLUME_TYPES, f"{where}: {kind}"
        for c in all_containers(spec):
            assert not c.get("ports") or all("hostPort" not in p for p in c["ports"]), where


def test_writable_paths_are_emptydirs(rendered: Rendered) -> None:
    wk = worker(rendered)
    spec = wk["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container(wk, "worker")["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["sizeLimit"] == "16Gi"
    assert "emptyDir" in volumes[mounts["/tmp"]]
    home = env_of(container(wk, "worker"))["HOME"]["value"]
    assert "emptyDir" in volumes[mounts[home]]
    assert env_of(container(wk, "worker"))["HF_HOME"]["value"].startswith(home + "/")
    sched = scheduler(rendered)
    sched_volumes = {v["name"]: v for v in sched["spec"]["template"]["spec"]["volumes"]}
    sched_mounts = {m["mountPath"]: m["name"] for m in container(sched, "scheduler")["volumeMounts"]}
    assert "emptyDir" in sched_volumes[sched_mounts["/tmp"]]


def test_images_default_to_app_version(render) -> None:
    rendered = render({})
    assert container(scheduler(rendered), "scheduler")["image"] == "bubblespec:0.1.0"
    assert container(worker(rendered), "worker")["image"] == "bubblespec-worker-gpu:0.1.0"
    big = render(VALUE_SETS["many-workers"])
    assert container(worker(big), "worker")["image"] == "registry.example.com/ml/bubblespec-worker-gpu:0.1.0"
    assert container(worker(render(VALUE_SETS["cpu-minimal"])), "worker")["image"] == "bubblespec-worker-cpu:dev"


def test_scheduler_command_probes_and_env(rendered: Rendered, value_set: str) -> None:
    sched = scheduler(rendered)
    assert sched["spec"]["replicas"] == 1
    assert sched["spec"]["strategy"]["type"] == "Recreate"
    c = container(sched, "scheduler")
    assert c["command"] + c["args"][:5] == ["bubblespec", "scheduler", "--grpc-port", "50051", "--http-port", "8080"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["grpc"]["port"] == 50051, probe
    env = env_of(c)
    for name in ("BUBBLESPEC_REDIS_URL", "BUBBLESPEC_TRAINER_TOKEN", "BUBBLESPEC_WORKER_TOKEN",
                 "BUBBLESPEC_TOKENIZER", "BUBBLESPEC_LOG_LEVEL"):
        assert name in env, name
    assert env["BUBBLESPEC_TRAINER_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "trainer-token"
    assert env["BUBBLESPEC_WORKER_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "worker-token"
    svc = rendered.one("Service", "-scheduler")
    assert {(p["name"], p["port"]) for p in svc["spec"]["ports"]} == {("grpc", 50051), ("http", 8080)}
    assert svc["spec"]["selector"] == selector_labels("scheduler")


def test_worker_command_probes_and_volumes(rendered: Rendered) -> None:
    wk = worker(rendered)
    c = container(wk, "worker")
    args = c["args"]
    assert c["command"] == ["bubblespec"] and args[0] == "worker"
    assert args[args.index("--scheduler") + 1] == SCHEDULER_ADDRESS
    assert args[args.index("--metrics-port") + 1] == "8081"
    assert args[args.index("--model") + 1].startswith("/models/")
    startup = c["startupProbe"]
    assert startup["httpGet"]["path"] == "/healthz"
    assert port_number(c, startup["httpGet"]["port"]) == 8081
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "model loading takes minutes"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    spec = wk["spec"]["template"]["spec"]
    model_volume = next(v for v in spec["volumes"] if v["name"] == "model")
    assert "persistentVolumeClaim" in model_volume or "hostPath" in model_volume
    model_mount = next(m for m in c["volumeMounts"] if m["name"] == "model")
    assert model_mount["readOnly"] is True
    assert wk["spec"]["podManagementPolicy"] == "Parallel"
    assert env_of(c)["BUBBLESPEC_WORKER_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "worker-token"
    assert "BUBBLESPEC_TRAINER_TOKEN" not in env_of(c), "workers never need the trainer token"
    assert env_of(c)["BUBBLESPEC_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_worker_gpu_resources(render, rendered: Rendered, value_set: str) -> None:
    limits = container(worker(rendered), "worker")["resources"]["limits"]
    values = VALUE_SETS[value_set].get("worker", {})
    if values.get("gpu", {}).get("enabled", True):
        assert limits["nvidia.com/gpu"] == values.get("tensorParallelSize", 1)
    else:
        assert "nvidia.com/gpu" not in limits


def test_worker_tensor_parallel_flag(render) -> None:
    c = container(worker(render({"worker": {"tensorParallelSize": 4}})), "worker")
    assert c["args"][c["args"].index("--tensor-parallel-size") + 1] == "4"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 4


def test_many_workers_placement(render) -> None:
    rendered = render(VALUE_SETS["many-workers"])
    wk = worker(rendered)
    spec = wk["spec"]["template"]["spec"]
    assert wk["spec"]["replicas"] == 64
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert {t["key"] for t in spec["tolerations"]} == {"nvidia.com/gpu", "dedicated"}
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert spec["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"
    weights = next(m for m in container(wk, "worker")["volumeMounts"] if m["name"] == "weights")
    assert weights["mountPath"] == "/weights" and weights["readOnly"] is True
    assert rendered.one("PodDisruptionBudget", "-worker")["spec"]["maxUnavailable"] == "10%"
    assert rendered.one("PodDisruptionBudget", "-scheduler")["spec"]["minAvailable"] == 1
    redis = rendered.one("StatefulSet", "-redis")
    assert redis["spec"]["volumeClaimTemplates"][0]["spec"]["storageClassName"] == "fast-ssd"


def test_service_monitors(render) -> None:
    rendered = render(VALUE_SETS["many-workers"])
    monitors = rendered.of_kind("ServiceMonitor")
    assert {m.name for m in monitors} == {f"{FULLNAME}-scheduler", f"{FULLNAME}-worker"}
    services = rendered.of_kind("Service")
    for m in monitors:
        assert m.obj["apiVersion"] == "monitoring.coreos.com/v1"
        assert m.obj["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        assert m.obj["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
        wanted = m.obj["spec"]["selector"]["matchLabels"]
        matching = [s for s in services if wanted.items() <= s.obj["metadata"]["labels"].items()]
        assert len(matching) == 1, m.name
        port_names = {p["name"] for p in matching[0].obj["spec"]["ports"]}
        for endpoint in m.obj["spec"]["endpoints"]:
            assert endpoint["port"] in port_names
            assert endpoint["path"] == "/metrics"
    assert render({}).of_kind("ServiceMonitor") == []


# --------------------------------------------------------------------------- Redis and secrets


def test_bundled_redis(render) -> None:
    rendered = render({})
    redis = rendered.one("StatefulSet", "-redis")
    assert "volumeClaimTemplates" not in redis["spec"], "persistence is off by default"
    svc = rendered.one("Service", "-redis")
    assert svc["spec"]["ports"][0]["port"] == 6379
    secret = rendered.one("Secret", "-redis")
    password_key = "redis-password"
    assert len(secret["data"][password_key]) > 0
    for obj, name in ((scheduler(rendered), "scheduler"), (worker(rendered), "worker")):
        env = env_of(container(obj, name))
        assert env["BUBBLESPEC_REDIS_URL"]["value"] == f"redis://{FULLNAME}-redis.{NAMESPACE}.svc:6379/0"
        ref = env["BUBBLESPEC_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": f"{FULLNAME}-redis", "key": password_key}
    # The password reaches redis-server through a private config file, never through argv.
    redis_container = container(redis, "redis")
    assert "requirepass" not in " ".join(redis_container["command"])
    assert "$(REDIS_PASSWORD)" not in " ".join(redis_container["args"])


def test_bundled_journal_redis_never_evicts_and_only_the_scheduler_uses_it(render) -> None:
    rendered = render({})
    redis = rendered.one("StatefulSet", "-redis")
    drafts, journal = container(redis, "redis"), container(redis, "journal")
    assert "maxmemory-policy allkeys-lru" in drafts["args"][0]
    assert "maxmemory-policy noeviction" in journal["args"][0] and "port 6380" in journal["args"][0]
    assert "maxmemory 256mb" in journal["args"][0]
    assert journal["ports"] == [{"name": "journal", "containerPort": 6380, "protocol": "TCP"}]
    svc = rendered.one("Service", "-redis")
    assert {(p["name"], p["port"]) for p in svc["spec"]["ports"]} == {("redis", 6379), ("journal", 6380)}
    env = env_of(container(scheduler(rendered), "scheduler"))
    assert env["BUBBLESPEC_JOURNAL_REDIS_URL"]["value"] == f"redis://{FULLNAME}-redis.{NAMESPACE}.svc:6380/0"
    assert env["BUBBLESPEC_JOURNAL_SECRET"]["valueFrom"]["secretKeyRef"] == {
        "name": f"{FULLNAME}-auth", "key": "journal-secret"}
    worker_env = env_of(container(worker(rendered), "worker"))
    assert "BUBBLESPEC_JOURNAL_SECRET" not in worker_env and "BUBBLESPEC_JOURNAL_REDIS_URL" not in worker_env
    custom = render({"redis": {"journal": {"port": 6390, "maxmemory": "1gb"}}, "auth": {"journalSecret": "j" * 20}})
    assert "maxmemory 1gb" in container(custom.one("StatefulSet", "-redis"), "journal")["args"][0]
    assert env_of(container(scheduler(custom), "scheduler"))["BUBBLESPEC_JOURNAL_REDIS_URL"]["value"].endswith(":6390/0")
    assert base64.b64decode(custom.one("Secret", "-auth")["data"]["journal-secret"]).decode() == "j" * 20


def test_external_journal_url(render) -> None:
    base = VALUE_SETS["external-redis-tls"]
    env = env_of(container(scheduler(render(base)), "scheduler"))
    assert "BUBBLESPEC_JOURNAL_REDIS_URL" not in env, "no journalUrl: the scheduler falls back to the store's URL"
    own = {**base, "redis": {**base["redis"], "external": {**base["redis"]["external"],
                                                           "journalUrl": "rediss://journal.data.svc:6380/0"}}}
    env = env_of(container(scheduler(render(own)), "scheduler"))
    assert env["BUBBLESPEC_JOURNAL_REDIS_URL"]["value"] == "rediss://journal.data.svc:6380/0"


def test_external_redis_with_tls(render) -> None:
    rendered = render(VALUE_SETS["external-redis-tls"])
    assert not [m for m in rendered.manifests if m.name.endswith("-redis")], "no bundled Redis objects"
    assert not [m for m in rendered.manifests
                if m.obj.get("metadata", {}).get("labels", {}).get("app.kubernetes.io/component") == "redis"]
    for obj, name in ((scheduler(rendered), "scheduler"), (worker(rendered), "worker")):
        c = container(obj, name)
        env = env_of(c)
        assert env["BUBBLESPEC_REDIS_URL"]["value"] == "rediss://redis.data.svc:6380/2"
        assert env["BUBBLESPEC_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
            "name": "rl-redis-credentials", "key": "password"}
        ca_file = env["BUBBLESPEC_REDIS_TLS_CA_FILE"]["value"]
        mount = next(m for m in c["volumeMounts"] if m["name"] == "redis-tls-ca")
        assert ca_file == f"{mount['mountPath']}/ca.pem"
        volume = next(v for v in obj["spec"]["template"]["spec"]["volumes"] if v["name"] == "redis-tls-ca")
        assert volume["secret"]["secretName"] == "rl-redis-ca"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"redis": {"enabled": False}}, "redis.external.url"),
        ({"redis": {"enabled": False, "external": {"url": "redis://r:6379/0", "tls": {"enabled": True}}}}, "rediss://"),
        ({"redis": {"enabled": False, "external": {"url": "rediss://r:6380/0"}}}, "tls.enabled"),
        ({"model": {"pvc": {"claimName": ""}}}, "model.pvc.claimName"),
        ({"weights": {"enabled": True}}, "weights.pvc.claimName"),
        ({"redis": {"enabled": False, "external": {"url": "redis://r:6379/0", "journalUrl": "rediss://j:6380/0"}}},
         "redis.external.journalUrl"),
    ],
)
def test_inconsistent_values_fail_with_a_clear_message(chart, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmRenderError, match=re.escape(message)):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


def test_generated_tokens(render) -> None:
    secret = render({}).one("Secret", "-auth")
    tokens = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert set(tokens) == {"trainer-token", "worker-token", "journal-secret"}
    assert all(len(t) == 48 and t.isalnum() for t in tokens.values())
    assert len(set(tokens.values())) == 3


def test_given_tokens_are_kept(render) -> None:
    secret = render({"auth": {"trainerToken": "t0ken-for-trainers", "workerToken": "w0rker"}}).one("Secret", "-auth")
    assert base64.b64decode(secret["data"]["trainer-token"]).decode() == "t0ken-for-trainers"
    assert base64.b64decode(secret["data"]["worker-token"]).decode() == "w0rker"


def test_existing_secrets(render) -> None:
    rendered = render(VALUE_SETS["existing-secrets"])
    assert rendered.of_kind("Secret") == [], "no chart-made Secret when existing ones are named"
    sched_env = env_of(container(scheduler(rendered), "scheduler"))
    assert sched_env["BUBBLESPEC_TRAINER_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "bubblespec-tokens"
    # An existing token Secret may predate the journal key: without it the scheduler keeps no journal.
    assert sched_env["BUBBLESPEC_JOURNAL_SECRET"]["valueFrom"]["secretKeyRef"] == {
        "name": "bubblespec-tokens", "key": "journal-secret", "optional": True}
    assert sched_env["BUBBLESPEC_WORKER_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "bubblespec-tokens"
    assert sched_env["BUBBLESPEC_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "bubblespec-redis-password"
    worker_env = env_of(container(worker(rendered), "worker"))
    assert worker_env["BUBBLESPEC_WORKER_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "bubblespec-tokens"
    model = next(v for v in worker(rendered)["spec"]["template"]["spec"]["volumes"] if v["name"] == "model")
    assert model["hostPath"]["path"] == "/mnt/models"
    args = container(worker(rendered), "worker")["args"]
    assert args[args.index("--model") + 1] == "/models/Llama-3.1-8B-Instruct"
    assert sched_env["BUBBLESPEC_TOKENIZER"]["value"] == "/models/Llama-3.1-8B-Instruct"


# --------------------------------------------------------------------------- NetworkPolicy


def _peers_for_port(policy: dict[str, Any], port_name: str) -> list[dict[str, Any]]:
    peers = []
    for rule in policy["spec"]["ingress"]:
        ports = rule.get("ports")
        assert ports, "an ingress rule without ports opens every port"
        assert rule.get("from"), "an ingress rule without peers admits everyone"
        if any(p["port"] == port_name for p in ports):
            peers.extend(rule["from"])
    return peers


def test_only_workers_and_trainers_reach_scheduler_grpc(render) -> None:
    policy = render({}).one("NetworkPolicy", "-scheduler")
    assert policy["spec"]["podSelector"]["matchLabels"] == selector_labels("scheduler")
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    peers = _peers_for_port(policy, "grpc")
    assert peers == [
        {"podSelector": {"matchLabels": selector_labels("worker")}},
        {"podSelector": {"matchLabels": {"bubblespec.io/trainer": "true"}}},
    ]
    # The HTTP port is for Prometheus only; no one else gets gRPC through it.
    http_peers = _peers_for_port(policy, "http")
    assert http_peers == [{
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        "podSelector": {},
    }]


def test_trainer_label_and_namespace_are_configurable(render) -> None:
    values = {"networkPolicy": {"trainerLabel": {"key": "team.example.com/role", "value": "ppo-trainer"},
                                "trainerNamespaceSelector": {"matchLabels": {"team": "rl"}}}}
    peers = _peers_for_port(render(values).one("NetworkPolicy", "-scheduler"), "grpc")
    assert peers[1] == {
        "podSelector": {"matchLabels": {"team.example.com/role": "ppo-trainer"}},
        "namespaceSelector": {"matchLabels": {"team": "rl"}},
    }
    assert peers[0] == {"podSelector": {"matchLabels": selector_labels("worker")}}


def test_only_scheduler_and_workers_reach_redis(render) -> None:
    policy = render({}).one("NetworkPolicy", "-redis")
    assert policy["spec"]["podSelector"]["matchLabels"] == selector_labels("redis")
    assert _peers_for_port(policy, "redis") == [
        {"podSelector": {"matchLabels": selector_labels("scheduler")}},
        {"podSelector": {"matchLabels": selector_labels("worker")}},
    ]


def test_only_the_scheduler_reaches_the_journal(render) -> None:
    policy = render({}).one("NetworkPolicy", "-redis")
    assert _peers_for_port(policy, "journal") == [{"podSelector": {"matchLabels": selector_labels("scheduler")}}]


def test_workers_accept_only_prometheus(render) -> None:
    policy = render({}).one("NetworkPolicy", "-worker")
    assert [r["ports"] for r in policy["spec"]["ingress"]] == [[{"port": "metrics", "protocol": "TCP"}]]
    assert "namespaceSelector" in policy["spec"]["ingress"][0]["from"][0]


def test_helm_test_pod_is_admitted_as_trainer(render) -> None:
    pod = next(m.obj for m in render({}).of_kind("Pod"))
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["metadata"]["labels"]["bubblespec.io/trainer"] == "true"
    assert SCHEDULER_ADDRESS in pod["spec"]["containers"][0]["args"][0]


# --------------------------------------------------------------------------- NOTES


def test_notes_tell_a_trainer_how_to_connect(render) -> None:
    notes = render({}).notes
    assert SCHEDULER_ADDRESS in notes
    assert "from bubblespec.client import RolloutClient" in notes
    assert f'RolloutClient("{SCHEDULER_ADDRESS}"' in notes
    assert f"{FULLNAME}-auth" in notes and "trainer-token" in notes
    assert f"port-forward svc/{FULLNAME}-scheduler 8080:8080" in notes
    assert "/ui" in notes


# --------------------------------------------------------------------------- values schema


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return json.loads((CHART_DIR / "values.schema.json").read_text())


@pytest.fixture(scope="module")
def default_values() -> dict[str, Any]:
    return yaml.safe_load((CHART_DIR / "values.yaml").read_text())


BAD_VALUES = [
    {"worker": {"replicaCount": -1}},
    {"worker": {"replicaCount": "many"}},
    {"worker": {"tensorParallelSize": 0}},
    {"scheduler": {"logLevel": "LOUD"}},
    {"scheduler": {"service": {"type": "ExternalName"}}},
    {"scheduler": {"ports": {"grpc": 70000}}},
    {"podSecurity": {"runAsUser": 0}},
    {"redis": {"maxmemoryPolicy": "keep-everything"}},
    {"redis": {"journal": {"maxmemory": "a lot"}}},
    {"auth": {"journalSecret": "too-short"}},
    {"redis": {"external": {"url": "http://redis:6379"}}},
    {"networkPolicy": {"trainerLabel": {"key": ""}}},
    {"networkPolicy": {"trainerLabel": {"value": True}}},
    {"worker": {"resources": {"limits": {"memory": "lots"}}}},
    {"worker": {"nodeSelector": {"gpu": True}}},
    {"replicaCount": 3},
    {"worker": {"gpus": 8}},
]


@pytest.mark.parametrize("bad", BAD_VALUES, ids=lambda v: json.dumps(v, sort_keys=True))
def test_schema_rejects_bad_values(chart, schema, bad: dict[str, Any]) -> None:
    # Helm applies values.schema.json itself when rendering...
    with pytest.raises(helm_python.HelmValuesError):
        chart.render(bad, name=RELEASE, namespace=NAMESPACE)
    # ...and the schema says the same to any draft-07 validator, on the merged values.
    errors = list(jsonschema.Draft7Validator(schema).iter_errors(chart.merge_values(bad)))
    assert errors, f"jsonschema accepted {bad}"


def _schema_node(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    """Follow $ref and single-element allOf wrappers."""
    while True:
        if "$ref" in node:
            node = schema["definitions"][node["$ref"].rsplit("/", 1)[1]]
        elif "allOf" in node and len(node["allOf"]) == 1 and "properties" not in node:
            node = node["allOf"][0]
        else:
            return node


def _walk(values: Any, node: dict[str, Any], schema: dict[str, Any], path: str) -> Iterator[str]:
    node = _schema_node(schema, node)
    assert "type" in node or "oneOf" in node, f"{path}: schema gives no type"
    if isinstance(values, dict) and "properties" in node:
        # Unknown keys are refused, or (resource lists) must at least fit a typed schema.
        assert node.get("additionalProperties", True) is not True, f"{path}: unknown keys would pass"
        for key, value in values.items():
            assert key in node["properties"], f"{path}.{key} missing from values.schema.json"
            assert node["properties"][key].get("description") or "$ref" in node["properties"][key] \
                or "allOf" in node["properties"][key], f"{path}.{key}: no description"
            yield f"{path}.{key}"
            yield from _walk(value, node["properties"][key], schema, f"{path}.{key}")


def test_schema_covers_every_value(schema, default_values) -> None:
    covered = list(_walk(default_values, schema, schema, ""))
    assert len(covered) > 100

    # And the other way round: every value the schema requires is in values.yaml (optional
    # properties are parts of Kubernetes types, such as a LabelSelector's matchExpressions).
    def described(node: dict[str, Any], path: str) -> Iterator[str]:
        node = _schema_node(schema, node)
        for key in node.get("required", []):
            yield f"{path}.{key}"
            yield from described(node["properties"][key], f"{path}.{key}")

    assert set(described(schema, "")) - set(covered) == set()


# --------------------------------------------------------------------------- values documentation

KEY_LINE = re.compile(r"^(\s*)(?:-\s+)?([A-Za-z0-9_.\"'/-]+):(\s|$)")


def test_every_value_has_a_comment_directly_above() -> None:
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()
    keys = 0
    undocumented = []
    for number, line in enumerate(lines):
        if line.lstrip().startswith("#") or not KEY_LINE.match(line):
            continue
        keys += 1
        above = lines[number - 1].strip() if number else ""
        if not above.startswith("#"):
            undocumented.append(f"values.yaml:{number + 1}: {line.strip()}")
    assert keys > 100
    assert undocumented == []


def test_comment_check_catches_an_undocumented_key() -> None:
    # The check above must not pass vacuously: feed it a key without a comment.
    text = "# documented\na: 1\nb:\n  # documented\n  c: 2\n"
    lines = text.splitlines()
    flagged = [ln for i, ln in enumerate(lines) if KEY_LINE.match(ln) and not lines[i - 1].strip().startswith("#")]
    assert flagged == ["b:"]


# --------------------------------------------------------------------------- docs


def test_deploy_guide_example_values_render(chart) -> None:
    # The values-prod.yaml example in docs/DEPLOY.md must install as written.
    guide = (CHART_DIR.parents[1] / "docs" / "DEPLOY.md").read_text()
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", guide, re.S)]
    example = next(b for b in blocks if isinstance(b, dict) and "redis" in b and "worker" in b)
    manifests = parse(chart.render(example, name=RELEASE, namespace=NAMESPACE))
    assert any(m.kind == "ServiceMonitor" for m in manifests)
    for m in manifests:
        if (m.obj["apiVersion"], m.kind) not in CRD_KINDS:
            kubernetes_validate.validate(m.obj, K8S_VERSION, strict=True)
