"""Value sets, rendering and parsing shared by the Helm chart tests.

Renders happen offline through helm-python-sdk (Helm v4 as a library, no helm binary, no
cluster). Each named value set is rendered once per session and cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = ROOT / "helm" / "bubblespec"
RELEASE = "rl"
NAMESPACE = "rollout"

# Value sets every manifest-level test runs against.
VALUE_SETS: dict[str, dict[str, Any]] = {
    # The chart as shipped.
    "defaults": {},
    # External Redis over TLS, password and CA from existing Secrets; model on a named PVC.
    "external-redis-tls": {
        "redis": {
            "enabled": False,
            "external": {
                "url": "rediss://redis.data.svc:6380/2",
                "existingSecret": "rl-redis-credentials",
                "passwordKey": "password",
                "tls": {"enabled": True, "caSecret": "rl-redis-ca", "caKey": "ca.pem"},
            },
        },
        "model": {"name": "Qwen2.5-7B-Instruct", "pvc": {"claimName": "models-rox"}},
    },
    # A large fleet: 64 TP-2 workers pinned to H100 nodes, ServiceMonitors on, weights volume,
    # persistent Redis, trainers admitted from another namespace.
    "many-workers": {
        "worker": {
            "replicaCount": 64,
            "tensorParallelSize": 2,
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                {"key": "dedicated", "operator": "Equal", "value": "rollout", "effect": "NoSchedule"},
            ],
            "topologySpreadConstraints": [
                {
                    "maxSkew": 1,
                    "topologyKey": "kubernetes.io/hostname",
                    "whenUnsatisfiable": "ScheduleAnyway",
                    "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "worker"}},
                }
            ],
            "runtimeClassName": "nvidia",
            "pdb": {"maxUnavailable": "10%"},
            "extraEnv": [{"name": "NCCL_DEBUG", "value": "WARN"}],
        },
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}},
        "weights": {"enabled": True, "pvc": {"claimName": "policy-weights-rwx"}},
        "redis": {"persistence": {"enabled": True, "storageClass": "fast-ssd"}},
        "scheduler": {"pdb": {"enabled": True}, "priorityClassName": "system-cluster-critical"},
        "networkPolicy": {"trainerNamespaceSelector": {"matchLabels": {"team": "rl"}}},
        "imagePullSecrets": ["regcred"],
        "image": {"registry": "registry.example.com/ml"},
    },
    # Tokens and the bundled Redis password from existing Secrets; model from a node directory.
    "existing-secrets": {
        "auth": {"existingSecret": "bubblespec-tokens"},
        "redis": {"auth": {"existingSecret": "bubblespec-redis-password"}},
        "model": {"hostPath": {"path": "/mnt/models"}, "name": "Llama-3.1-8B-Instruct"},
    },
    # CPU workers (Dockerfile.worker-cpu), no NetworkPolicies, no helm test, no Redis password.
    "cpu-minimal": {
        "worker": {
            "gpu": {"enabled": False},
            "image": {"repository": "bubblespec-worker-cpu", "tag": "dev"},
            "tolerations": [],
            "replicaCount": 1,
        },
        "networkPolicy": {"enabled": False},
        "helmTest": {"enabled": False},
        "redis": {"auth": {"enabled": False}},
        "serviceAccount": {"create": False},
        "scheduler": {"mountModelVolume": False, "tokenizer": "/opt/tokenizer"},
    },
}


@dataclass(frozen=True)
class Manifest:
    """One rendered Kubernetes object and the template it came from."""

    template: str
    obj: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.obj["kind"])

    @property
    def name(self) -> str:
        return str(self.obj["metadata"]["name"])


@dataclass(frozen=True)
class Rendered:
    """A whole rendered release."""

    files: dict[str, str]
    manifests: list[Manifest]

    def of_kind(self, kind: str) -> list[Manifest]:
        return [m for m in self.manifests if m.kind == kind]

    def one(self, kind: str, name_suffix: str) -> dict[str, Any]:
        found = [m.obj for m in self.of_kind(kind) if m.name.endswith(name_suffix)]
        assert len(found) == 1, f"expected one {kind} named *{name_suffix}, got {len(found)}"
        return found[0]

    @property
    def notes(self) -> str:
        return next(v for k, v in self.files.items() if k.endswith("NOTES.txt"))


def parse(files: dict[str, str]) -> list[Manifest]:
    manifests = []
    for template, text in sorted(files.items()):
        if not template.endswith((".yaml", ".yml")):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                manifests.append(Manifest(template, doc))
    return manifests


