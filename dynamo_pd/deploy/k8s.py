"""The Kubernetes manifests of a dynamo-pd deployment: the dicts `kubectl apply` takes (__main__ prints YAML).

What `render` returns, in order; every object is labelled app.kubernetes.io/instance=<name> and
app.kubernetes.io/component=<what it is>:
  Namespace            --k8s-namespace
  ServiceAccount, Role, RoleBinding   <name>-planner: get/list/watch/patch of Deployments and
                       deployments/scale in the namespace, what the planner's Kubernetes connector needs
  Secret <name>-secrets   the cluster secret and the API key from --cluster-secret-file / --api-key-file
                       (--cluster-secret-ref / --api-key-ref name a Secret that exists instead; the
                       environment is never read)
  ConfigMap <name>-config   gateway.toml from --config, mounted into the frontend
  etcd, NATS           a Deployment and a Service each, unless --etcd / --nats name servers that exist
  frontend             a Deployment (readiness /ready, liveness /health on its HTTP port), a Service, a PDB
  worker pools         prefill and decode (or one aggregated pool): a Deployment each, readiness /ready on
                       the worker's metrics port (its engine started and it registered in discovery; 503
                       again while it drains), SIGTERM drains it (no preStop hook needed) within
                       terminationGracePeriodSeconds = --drain-timeout-s + 15, rolling updates with
                       maxUnavailable 0 / maxSurge 1 (a pool never has fewer ready pods than asked),
                       nvidia.com/gpu for the GPU engines; a headless Service and a PodDisruptionBudget
                       (minAvailable 1) per pool
  ServiceMonitor       with --service-monitor (the Prometheus Operator's); every pod carries prometheus.io/*
                       scrape annotations anyway
Discovery is etcd and the event plane NATS: the frontend's embedded discovery lives in one process.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass

from dynamo_pd.credentials import API_KEY_ENV
from dynamo_pd.runtime.security import SECRET_ENV

GPU_ENGINES = ("vllm", "sglang", "trtllm")
ENGINES = ("native", "mocker", *GPU_ENGINES)
HTTP_PORT = 8000
METRICS_PORT = 9090
ETCD_PORT = 2379
NATS_PORT = 4222
DRAIN_MARGIN_S = 15  # after the drain: the worker leaves its planes and stops its engine
_CONFIG_DIR = "/etc/dynamo-pd"
_CACHE_DIR = "/cache"
_ROLLING = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
# the Dockerfile's user; fsGroup: it may write a model cache claim
_USER = {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 1000}


@dataclass(frozen=True)
class SecretRef:
    """A key of a Secret in the namespace (`kubectl create secret generic NAME --from-file=KEY=PATH`)."""

    name: str
    key: str


@dataclass(frozen=True)
class Resources:
    cpu: str  # Kubernetes quantities: "2", "500m"
    memory: str  # "8Gi"
    gpus: int = 0  # nvidia.com/gpu

    def spec(self) -> dict:
        requests: dict = {"cpu": self.cpu, "memory": self.memory}
        limits: dict = {"memory": self.memory}  # no CPU limit: throttling a step costs more than it saves
        if self.gpus:
            requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = self.gpus
        return {"requests": requests, "limits": limits}

    def threads(self) -> int:
        """OpenMP threads for the CPU request (torch would start one per core of the node)."""
        cores = float(self.cpu[:-1]) / 1000 if self.cpu.endswith("m") else float(self.cpu)
        return max(1, math.floor(cores))


@dataclass(frozen=True)
class K8sPlan:
    prefill: int = 1
    decode: int = 1
    aggregated: int = 0  # > 0: one aggregated pool instead of prefill and decode
    engine: str = "native"
    name: str = "dynamo-pd"  # the prefix of every object's name
    k8s_namespace: str = "dynamo-pd"
    namespace: str = "dynamo_pd"  # dynamo-pd's own: discovery keys and event subjects live under it
    image: str = "dynamo-pd:latest"
    image_pull_policy: str = "IfNotPresent"
    frontend_replicas: int = 1
    worker: Resources = Resources("2", "8Gi")
    frontend: Resources = Resources("1", "2Gi")
    drain_timeout_s: float = 30.0
    kv_transport: str = "zmq"
    kv_handoff: str = "pull"
    etcd: str | None = None  # etcd://HOST:PORT that exists; None: one is deployed
    nats: str | None = None  # nats://HOST:PORT that exists; None: one is deployed
    etcd_image: str = "quay.io/coreos/etcd:v3.5.21"
    nats_image: str = "nats:2.11-alpine"
    gateway_toml: str | None = None  # the --config file's text
    cluster_secret: str | SecretRef | None = None  # the secret itself (from a file) or where one is
    api_key: str | SecretRef | None = None
    service_type: str = "ClusterIP"
    service_monitor: bool = False
    model_cache_pvc: str | None = None  # a claim for the model cache; None: an emptyDir per pod
    shm_size: str = "1Gi"
    worker_args: tuple[str, ...] = ()  # engine and worker flags, passed as given
    frontend_args: tuple[str, ...] = ()

    @property
    def pools(self) -> list[tuple[str, int]]:
        """(role, replicas) of each worker pool deployed (a decode pool may prefill alone: --prefill 0)."""
        if self.aggregated:
            return [("aggregated", self.aggregated)]
        return [(role, n) for role, n in (("prefill", self.prefill), ("decode", self.decode)) if n]

    @property
    def discovery_url(self) -> str:
        return self.etcd or f"etcd://{self.name}-etcd:{ETCD_PORT}"

    @property
    def events_url(self) -> str:
        return self.nats or f"nats://{self.name}-nats:{NATS_PORT}"

    @property
    def grace_s(self) -> int:
        return math.ceil(self.drain_timeout_s) + DRAIN_MARGIN_S


def render(plan: K8sPlan) -> list[dict]:
    docs = [{"apiVersion": "v1", "kind": "Namespace",
             "metadata": {"name": plan.k8s_namespace, "labels": _labels(plan, "namespace")}}]
    docs += _planner_rbac(plan)
    docs += _secret(plan)
    if plan.gateway_toml is not None:
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(plan, "config", "frontend"),
                     "data": {"gateway.toml": plan.gateway_toml}})
    if plan.etcd is None:
        docs += _etcd(plan)
    if plan.nats is None:
        docs += _nats(plan)
    docs += _frontend(plan)
    for role, replicas in plan.pools:
        docs += _pool(plan, role, replicas)
    if plan.service_monitor:
        docs.append(_service_monitor(plan))
    return docs


# ---- pieces

def _labels(plan: K8sPlan, component: str) -> dict:
    return {"app.kubernetes.io/name": "dynamo-pd", "app.kubernetes.io/instance": plan.name,
            "app.kubernetes.io/component": component}


def _selector(plan: K8sPlan, component: str) -> dict:
    return {"app.kubernetes.io/instance": plan.name, "app.kubernetes.io/component": component}


def _meta(plan: K8sPlan, suffix: str, component: str) -> dict:
    return {"name": f"{plan.name}-{suffix}", "namespace": plan.k8s_namespace,
            "labels": _labels(plan, component)}


def _secret_ref(plan: K8sPlan, value: str | SecretRef, key: str) -> dict:
    ref = value if isinstance(value, SecretRef) else SecretRef(f"{plan.name}-secrets", key)
    return {"secretKeyRef": {"name": ref.name, "key": ref.key}}


def _secret_env(plan: K8sPlan, api_key: bool) -> list[dict]:
    """The cluster secret (every process) and the API key (the frontend), as credentials.py reads them."""
    env = []
    if plan.cluster_secret is not None:
        env.append({"name": SECRET_ENV,
                    "valueFrom": _secret_ref(plan, plan.cluster_secret, "cluster-secret")})
    if api_key and plan.api_key is not None:
        env.append({"name": API_KEY_ENV, "valueFrom": _secret_ref(plan, plan.api_key, "api-key")})
    return env


def _pod_env() -> list[dict]:
    return [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]


def _scrape(port: int) -> dict:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}


def _probe(path: str, port: str, period_s: int, failures: int) -> dict:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period_s, "timeoutSeconds": 5,
            "failureThreshold": failures}


def _deployment(plan: K8sPlan, suffix: str, component: str, replicas: int, pod: dict, strategy: dict) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(plan, suffix, component),
            "spec": {"replicas": replicas, "selector": {"matchLabels": _selector(plan, component)},
                     "strategy": strategy, "template": pod}}


def _service(plan: K8sPlan, suffix: str, component: str, ports: list[dict], **spec) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(plan, suffix, component),
            "spec": {**spec, "selector": _selector(plan, component), "ports": ports}}


def _pdb(plan: K8sPlan, suffix: str, component: str) -> dict:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _meta(plan, suffix, component),
            "spec": {"minAvailable": 1, "selector": {"matchLabels": _selector(plan, component)}}}


def _planner_rbac(plan: K8sPlan) -> list[dict]:
    meta = _meta(plan, "planner", "planner")
    verbs = ["get", "list", "watch", "patch"]
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta,
         "rules": [{"apiGroups": ["apps"], "resources": ["deployments", "deployments/scale"],
                    "verbs": verbs}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": meta["name"]},
         "subjects": [{"kind": "ServiceAccount", "name": meta["name"], "namespace": plan.k8s_namespace}]},
    ]


def _secret(plan: K8sPlan) -> list[dict]:
    given = (("cluster-secret", plan.cluster_secret), ("api-key", plan.api_key))
    data = {key: base64.b64encode(value.encode()).decode() for key, value in given if isinstance(value, str)}
    if not data:
        return []
    return [{"apiVersion": "v1", "kind": "Secret", "metadata": _meta(plan, "secrets", "secrets"),
             "type": "Opaque", "data": data}]


def _etcd(plan: K8sPlan) -> list[dict]:
    container = {
        "name": "etcd", "image": plan.etcd_image, "command": ["etcd"],
        "args": ["--name", "etcd", "--data-dir", "/var/lib/etcd",
                 "--listen-client-urls", f"http://0.0.0.0:{ETCD_PORT}",
                 "--advertise-client-urls", f"http://{plan.name}-etcd:{ETCD_PORT}"],
        "ports": [{"name": "client", "containerPort": ETCD_PORT}],
        "readinessProbe": _probe("/health", "client", 5, 3),
        "resources": Resources("250m", "512Mi").spec(),
        "volumeMounts": [{"name": "data", "mountPath": "/var/lib/etcd"}],
    }
    # Registrations live under leases the workers renew: an etcd that restarts empty is refilled within one
    # keep-alive (they register again), so its data need not outlive the pod.
    pod = {"metadata": {"labels": _labels(plan, "etcd")},
           "spec": {"containers": [container], "volumes": [{"name": "data", "emptyDir": {}}]}}
    return [_deployment(plan, "etcd", "etcd", 1, pod, {"type": "Recreate"}),
            _service(plan, "etcd", "etcd", [{"name": "client", "port": ETCD_PORT, "targetPort": "client"}])]


def _nats(plan: K8sPlan) -> list[dict]:
    container = {
        "name": "nats", "image": plan.nats_image, "args": ["--port", str(NATS_PORT), "--http_port", "8222"],
        "ports": [{"name": "client", "containerPort": NATS_PORT}, {"name": "monitor", "containerPort": 8222}],
        "readinessProbe": _probe("/healthz", "monitor", 5, 3),
        "resources": Resources("250m", "256Mi").spec(),
    }
    pod = {"metadata": {"labels": _labels(plan, "nats")}, "spec": {"containers": [container]}}
    return [_deployment(plan, "nats", "nats", 1, pod, {"type": "Recreate"}),
            _service(plan, "nats", "nats", [{"name": "client", "port": NATS_PORT, "targetPort": "client"}])]


def _planes(plan: K8sPlan) -> list[str]:
    """Where every process finds the others: bind every interface, advertise the pod's address."""
    return ["--host", "0.0.0.0", "--advertise-host", "$(POD_IP)", "--discovery", plan.discovery_url,
            "--events", plan.events_url, "--namespace", plan.namespace]


def _frontend(plan: K8sPlan) -> list[dict]:
    config = ["--config", f"{_CONFIG_DIR}/gateway.toml"] if plan.gateway_toml is not None else []
    container = {
        "name": "frontend", "image": plan.image, "imagePullPolicy": plan.image_pull_policy,
        "command": ["python", "-m", "dynamo_pd.frontend"],
        "args": ["--port", str(HTTP_PORT), *_planes(plan), *config, *plan.frontend_args],
        "env": [*_pod_env(), *_secret_env(plan, api_key=True)],
        "ports": [{"name": "http", "containerPort": HTTP_PORT}],
        "startupProbe": _probe("/health", "http", 5, 60),
        "readinessProbe": _probe("/ready", "http", 5, 2),  # 503 until a worker serves a model
        "livenessProbe": _probe("/health", "http", 10, 6),
        "resources": plan.frontend.spec(),
    }
    spec: dict = {"securityContext": _USER, "containers": [container], "automountServiceAccountToken": False}
    if config:
        container["volumeMounts"] = [{"name": "config", "mountPath": _CONFIG_DIR, "readOnly": True}]
        spec["volumes"] = [{"name": "config", "configMap": {"name": f"{plan.name}-config"}}]
    pod = {"metadata": {"labels": _labels(plan, "frontend"), "annotations": _scrape(HTTP_PORT)}, "spec": spec}
    return [_deployment(plan, "frontend", "frontend", plan.frontend_replicas, pod, _ROLLING),
            _service(plan, "frontend", "frontend",
                     [{"name": "http", "port": HTTP_PORT, "targetPort": "http"}], type=plan.service_type),
            _pdb(plan, "frontend", "frontend")]


def _pool(plan: K8sPlan, role: str, replicas: int) -> list[dict]:
    device = ["--device", "cuda"] if plan.engine == "native" and plan.worker.gpus else []
    args = ["--engine", plan.engine, "--worker-id", "$(POD_NAME)", *_planes(plan),
            "--kv-transport", plan.kv_transport, "--kv-handoff", plan.kv_handoff,
            "--metrics-port", str(METRICS_PORT), "--drain-timeout-s", f"{plan.drain_timeout_s:g}",
            *device, *plan.worker_args]
    env = [*_pod_env(), *_secret_env(plan, api_key=False),
           {"name": "DYNAMO_PD_CACHE", "value": _CACHE_DIR},
           {"name": "HF_HOME", "value": f"{_CACHE_DIR}/huggingface"},
           {"name": "OMP_NUM_THREADS", "value": str(plan.worker.threads())}]
    container = {
        "name": "worker", "image": plan.image, "imagePullPolicy": plan.image_pull_policy,
        "command": ["python", "-m", f"dynamo_pd.{role}"], "args": args, "env": env,
        "ports": [{"name": "metrics", "containerPort": METRICS_PORT}],
        # /health answers from before the engine loads: a long model load is alive, and not ready
        "startupProbe": _probe("/health", "metrics", 5, 60),
        "readinessProbe": _probe("/ready", "metrics", 5, 1),
        "livenessProbe": _probe("/health", "metrics", 10, 6),
        "resources": plan.worker.spec(),
        "volumeMounts": [{"name": "cache", "mountPath": _CACHE_DIR},
                         {"name": "shm", "mountPath": "/dev/shm"}],
    }
    cache = ({"persistentVolumeClaim": {"claimName": plan.model_cache_pvc}} if plan.model_cache_pvc
             else {"emptyDir": {}})
    shm = {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": plan.shm_size}}
    pod = {"metadata": {"labels": _labels(plan, role), "annotations": _scrape(METRICS_PORT)},
           "spec": {"terminationGracePeriodSeconds": plan.grace_s, "securityContext": _USER,
                    "containers": [container], "automountServiceAccountToken": False,
                    "volumes": [{"name": "cache", **cache}, shm]}}
    return [_deployment(plan, role, role, replicas, pod, _ROLLING),
            _service(plan, role, role, [{"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics"}],
                     clusterIP="None"),
            _pdb(plan, role, role)]


def _service_monitor(plan: K8sPlan) -> dict:
    frontend = {"port": "http", "path": "/metrics", "interval": "15s"}
    if plan.api_key is not None:  # every frontend route but /health and /ready wants the key
        ref = _secret_ref(plan, plan.api_key, "api-key")["secretKeyRef"]
        frontend["authorization"] = {"type": "Bearer", "credentials": ref}
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": _meta(plan, "metrics", "metrics"),
            "spec": {"selector": {"matchLabels": {"app.kubernetes.io/instance": plan.name}},
                     "endpoints": [frontend, {"port": "metrics", "path": "/metrics", "interval": "15s"}]}}
