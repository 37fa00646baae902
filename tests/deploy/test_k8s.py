"""`python -m dynamo_pd.deploy k8s`: every manifest validates against the Kubernetes API's own schemas (the
newest minor version kubernetes-validate ships, strict: no unknown field), for native, vLLM, SGLang and
TensorRT-LLM pools, aggregated and disaggregated; and they mean what the deployment needs (probes on the
port and path the processes serve, the processes' real flags, drain grace, rolling updates, GPUs, secrets)."""

from __future__ import annotations

import base64
import copy
import os
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from dynamo_pd.deploy.__main__ import plan_from_args
from dynamo_pd.deploy.k8s import DRAIN_MARGIN_S, render
from dynamo_pd.engines.base import EngineRole
from dynamo_pd.frontend.__main__ import parse_args as frontend_args
from dynamo_pd.worker import parse_args as worker_args

K8S = kubernetes_validate.latest_version()
TOPOLOGIES = {"disaggregated": ["--prefill", "2", "--decode", "3"], "aggregated": ["--aggregated", "2"]}
POD_ENV = {"$(POD_NAME)": "dynamo-pd-decode-5d8f7-x2x9q", "$(POD_IP)": "10.1.2.3"}
ROOT = Path(__file__).parents[2]


def manifests(*args: str) -> list[dict]:
    return render(plan_from_args(["k8s", *args]))


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def resolved(args: list[str]) -> list[str]:
    """A container's args as the kubelet passes them: $(VAR) replaced by the pod's values."""
    return [POD_ENV.get(arg, arg) for arg in args]


def validate(doc: dict) -> None:
    kubernetes_validate.validate(doc, K8S, strict=True)


@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
@pytest.mark.parametrize("engine", ["native", "vllm", "sglang", "trtllm"])
def test_every_manifest_validates_against_the_kubernetes_schemas(engine, topology):
    docs = manifests("--engine", engine, *TOPOLOGIES[topology], "--service-monitor", "--model", "Qwen/Qwen3-8B")
    kinds = [doc["kind"] for doc in docs]
    for doc in docs:
        if doc["kind"] != "ServiceMonitor":  # the Prometheus Operator's own resource: checked below
            validate(doc)
    assert kinds.count("ServiceMonitor") == 1
    pools = ["aggregated"] if topology == "aggregated" else ["prefill", "decode"]
    deployments = by_kind(docs, "Deployment")
    assert sorted(deployments) == sorted(f"dynamo-pd-{name}" for name in ["frontend", "etcd", "nats", *pools])
    for pool in pools:
        resources = container(deployments[f"dynamo-pd-{pool}"])["resources"]
        gpus = 0 if engine == "native" else 1  # vLLM, SGLang and TensorRT-LLM need one each
        assert resources["requests"].get("nvidia.com/gpu", 0) == resources["limits"].get("nvidia.com/gpu", 0) == gpus
    assert {"Namespace", "ServiceAccount", "Role", "RoleBinding", "Service", "PodDisruptionBudget"} <= set(kinds)


def test_a_manifest_the_api_would_refuse_fails_validation():
    """The check above has teeth: a wrong type and an unknown field (strict) are refused."""
    docs = manifests()
    deployment = copy.deepcopy(by_kind(docs, "Deployment")["dynamo-pd-decode"])
    deployment["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    probe = copy.deepcopy(by_kind(docs, "Deployment")["dynamo-pd-decode"])
    container(probe)["readinessProbe"]["httpGet"]["paht"] = "/ready"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(probe)


def test_workers_drain_within_their_grace_roll_without_an_empty_pool_and_probe_what_they_serve():
    docs = manifests("--prefill", "2", "--decode", "3", "--drain-timeout-s", "45", "--block-size", "32")
    deployments, services = by_kind(docs, "Deployment"), by_kind(docs, "Service")
    pdbs = by_kind(docs, "PodDisruptionBudget")
    for role, replicas in (("prefill", 2), ("decode", 3)):
        deployment = deployments[f"dynamo-pd-{role}"]
        pod, spec = deployment["spec"]["template"], deployment["spec"]
        c = container(deployment)
        assert spec["replicas"] == replicas
        assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
        assert pod["spec"]["terminationGracePeriodSeconds"] == 45 + DRAIN_MARGIN_S > 45
        assert "lifecycle" not in c  # SIGTERM itself drains the worker: no preStop hook
        # the worker's own parser reads its flags as the kubelet passes them
        config = worker_args(EngineRole(role), resolved(c["args"]))
        assert c["command"] == ["python", "-m", f"dynamo_pd.{role}"]
        assert (config.drain_timeout_s, config.engine_config.block_size) == (45.0, 32)
        assert (config.host, config.advertise_host, config.worker_id) == ("0.0.0.0", "10.1.2.3", POD_ENV["$(POD_NAME)"])
        assert (config.discovery, config.events) == ("etcd://dynamo-pd-etcd:2379", "nats://dynamo-pd-nats:4222")
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports == {"metrics": config.metrics_port}
        for probe, path in (("readinessProbe", "/ready"), ("livenessProbe", "/health"), ("startupProbe", "/health")):
            assert c[probe]["httpGet"] == {"path": path, "port": "metrics"}
        annotations = pod["metadata"]["annotations"]
        assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(config.metrics_port),
                               "prometheus.io/path": "/metrics"}
        labels = pod["metadata"]["labels"]
        for selector in (spec["selector"]["matchLabels"], services[f"dynamo-pd-{role}"]["spec"]["selector"],
                         pdbs[f"dynamo-pd-{role}"]["spec"]["selector"]["matchLabels"]):
            assert selector.items() <= labels.items()
        assert pdbs[f"dynamo-pd-{role}"]["spec"]["minAvailable"] == 1
        assert services[f"dynamo-pd-{role}"]["spec"]["clusterIP"] == "None"
        threads = {e["name"]: e.get("value") for e in c["env"]}["OMP_NUM_THREADS"]
        assert threads == "2"  # the CPU request, not the node's cores


def test_the_frontend_reads_its_flags_and_the_config_map_and_is_probed_on_its_http_port(tmp_path):
    toml = '[health]\ninterval_s = 5.0\n\n[models."SmolLM2-135M-Instruct"]\nfallback = "smol-b"\n'
    (tmp_path / "gateway.toml").write_text(toml)
    docs = manifests("--config", str(tmp_path / "gateway.toml"), "--router-policy", "round_robin",
                     "--frontend-replicas", "2")
    (config_map,) = by_kind(docs, "ConfigMap").values()
    assert config_map["data"] == {"gateway.toml": toml}
    deployment = by_kind(docs, "Deployment")["dynamo-pd-frontend"]
    c, pod = container(deployment), deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    (mount,) = c["volumeMounts"]
    assert pod["volumes"] == [{"name": mount["name"], "configMap": {"name": config_map["metadata"]["name"]}}]
    args = resolved(c["args"])
    mounted = args[args.index("--config") + 1]
    assert Path(mounted).parent == Path(mount["mountPath"]) and Path(mounted).name in config_map["data"]
    # the frontend's own parser, the mounted file where the ConfigMap puts it
    (tmp_path / "mounted").mkdir()
    (tmp_path / "mounted" / Path(mounted).name).write_text(config_map["data"][Path(mounted).name])
    parsed = frontend_args([str(tmp_path / "mounted" / Path(mounted).name) if a == mounted else a for a in args])
    assert (parsed.port, parsed.host, parsed.router_policy) == (8000, "0.0.0.0", "round_robin")
    assert parsed.gateway.fallbacks == {"SmolLM2-135M-Instruct": "smol-b"} and parsed.gateway.health.interval_s == 5.0
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": parsed.port}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    service = by_kind(docs, "Service")["dynamo-pd-frontend"]
    assert service["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http"}]


def test_secrets_come_from_files_or_references_never_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNAMO_PD_CLUSTER_SECRET", "from-the-environment-0123456789")
    monkeypatch.setenv("DYNAMO_PD_API_KEY", "sk-from-the-environment")
    (tmp_path / "secret").write_text("cluster-secret-0123456789abcdef\n")
    (tmp_path / "key").write_text("sk-from-a-file\n")
    docs = manifests("--cluster-secret-file", str(tmp_path / "secret"), "--api-key-file", str(tmp_path / "key"))
    (secret,) = by_kind(docs, "Secret").values()
    assert {k: base64.b64decode(v).decode() for k, v in secret["data"].items()} == {
        "cluster-secret": "cluster-secret-0123456789abcdef", "api-key": "sk-from-a-file"}
    envs = {name: {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container(d).get("env", [])
                   if "secretKeyRef" in e.get("valueFrom", {})} for name, d in by_kind(docs, "Deployment").items()}
    ref = {"name": secret["metadata"]["name"]}
    assert envs["dynamo-pd-frontend"] == {"DYNAMO_PD_CLUSTER_SECRET": {**ref, "key": "cluster-secret"},
                                          "DYNAMO_PD_API_KEY": {**ref, "key": "api-key"}}
    for worker in ("dynamo-pd-prefill", "dynamo-pd-decode"):  # the workers need no API key
        assert envs[worker] == {"DYNAMO_PD_CLUSTER_SECRET": {**ref, "key": "cluster-secret"}}

    refs = manifests("--cluster-secret-ref", "prod-secrets:curve", "--api-key-ref", "prod-secrets:openai",
                     "--service-monitor")
    assert not by_kind(refs, "Secret")
    frontend = container(by_kind(refs, "Deployment")["dynamo-pd-frontend"])
    assert [e["valueFrom"]["secretKeyRef"] for e in frontend["env"] if e["name"].startswith("DYNAMO_PD_")] == [
        {"name": "prod-secrets", "key": "curve"}, {"name": "prod-secrets", "key": "openai"}]
    (monitor,) = by_kind(refs, "ServiceMonitor").values()  # it scrapes the frontend with the API key
    http = next(e for e in monitor["spec"]["endpoints"] if e["port"] == "http")
    assert http["authorization"] == {"type": "Bearer", "credentials": {"name": "prod-secrets", "key": "openai"}}
    from_env = [os.environ["DYNAMO_PD_CLUSTER_SECRET"], os.environ["DYNAMO_PD_API_KEY"]]
    for rendered in (docs, refs, manifests()):
        text = yaml.safe_dump_all(rendered)
        assert not [v for v in from_env if v in text or base64.b64encode(v.encode()).decode() in text]
    assert not by_kind(manifests(), "Secret") and "DYNAMO_PD_CLUSTER_SECRET" not in yaml.safe_dump_all(manifests())


def test_the_planner_may_scale_the_pools_and_nothing_else():
    docs = manifests()
    (role,), (binding,), (account,) = (by_kind(docs, k).values() for k in ("Role", "RoleBinding", "ServiceAccount"))
    assert role["rules"] == [{"apiGroups": ["apps"], "resources": ["deployments", "deployments/scale"],
                              "verbs": ["get", "list", "watch", "patch"]}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": "dynamo-pd"}]
    assert all(doc["metadata"].get("namespace", "dynamo-pd") == "dynamo-pd" for doc in docs)


def test_external_etcd_and_nats_replace_the_deployed_ones_and_gpus_are_asked_for():
    docs = manifests("--etcd", "etcd://etcd.infra:2379", "--nats", "nats://nats.infra:4222", "--engine", "native",
                     "--gpus-per-worker", "1", "--aggregated", "1")
    deployments = by_kind(docs, "Deployment")
    assert sorted(deployments) == ["dynamo-pd-aggregated", "dynamo-pd-frontend"]
    c = container(deployments["dynamo-pd-aggregated"])
    config = worker_args(EngineRole.AGGREGATED, resolved(c["args"]))
    assert (config.discovery, config.events) == ("etcd://etcd.infra:2379", "nats://nats.infra:4222")
    assert config.engine_config.device == "cuda"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_the_service_monitor_scrapes_ports_the_services_have():
    docs = manifests("--service-monitor")
    (monitor,) = by_kind(docs, "ServiceMonitor").values()
    selected = [s for s in by_kind(docs, "Service").values()
                if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    ports = {p["name"] for s in selected for p in s["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} == {"http", "metrics"} <= ports


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYNAMO_PD_")}
    return subprocess.run([sys.executable, "-m", "dynamo_pd.deploy", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_the_command_prints_yaml_that_validates():
    done = run_cli("k8s", "--prefill", "1", "--decode", "2", "--engine", "vllm", "--block-size", "32")
    assert done.returncode == 0, done.stderr
    assert "are plain (no CURVE)" in done.stderr  # no cluster secret given: said, not silent
    docs = list(yaml.safe_load_all(done.stdout))
    for doc in docs:
        validate(doc)
    assert "&id" not in done.stdout  # every object printed whole, no YAML anchors
    decode = container(by_kind(docs, "Deployment")["dynamo-pd-decode"])
    assert decode["args"][-2:] == ["--block-size", "32"]  # engine flags reach the workers as given


@pytest.mark.parametrize(("args", "flag"), [
    (["--prefill", "-1"], "--prefill"),
    (["--aggregated", "2", "--decode", "1"], "--aggregated"),
    (["--name", "Bad_Name"], "--name"),
    (["--k8s-namespace", "x" * 64], "--k8s-namespace"),
    (["--worker-memory", "lots"], "--worker-memory"),
    (["--worker-cpu", "0"], "--worker-cpu"),
    (["--worker-cpu", "2Gi"], "--worker-cpu"),
    (["--etcd", "http://etcd:2379"], "--etcd"),
    (["--engine", "sglang", "--gpus-per-worker", "0"], "--gpus-per-worker"),
    (["--cluster-secret-ref", "no-key"], "--cluster-secret-ref"),
    (["--cluster-secret-ref", "a:b", "--cluster-secret-file", "f"], "--cluster-secret-file"),
    (["--frontend-replicas", "0"], "--frontend-replicas"),
    (["--drain-timeout-s", "-1"], "--drain-timeout-s"),
    (["--router-policy", "nope"], "--router-policy"),
    (["--engine", "tgi"], "--engine"),
    (["--namespace", "a/b"], "--namespace"),
    (["stray"], "stray"),
])
def test_bad_input_is_one_line_naming_the_flag(args, flag):
    done = run_cli("k8s", *args)
    assert done.returncode != 0 and not done.stdout
    assert "Traceback" not in done.stderr and flag in done.stderr.strip().splitlines()[-1], done.stderr


def test_bad_files_are_named(tmp_path):
    (tmp_path / "short").write_text("too-short\n")
    (tmp_path / "bad.toml").write_text("[health]\ninterval_s = -1\n")
    for args, flag in ((["--cluster-secret-file", str(tmp_path / "short")], "--cluster-secret-file"),
                       (["--api-key-file", str(tmp_path / "missing")], "--api-key-file"),
                       (["--config", str(tmp_path / "bad.toml")], "--config")):
        done = run_cli("k8s", *args)
        assert done.returncode != 0 and not done.stdout and "Traceback" not in done.stderr
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and flag in last, done.stderr


def test_the_dockerfile_copies_what_exists_and_the_pods_run_modules_that_do():
    dockerfile = (ROOT / "Dockerfile").read_text()
    copied = [line.split()[1:-1] for line in dockerfile.splitlines() if line.startswith("COPY ")]
    assert copied and all((ROOT / path).exists() for paths in copied for path in paths)
    modules = {container(d)["command"][2] for d in by_kind(manifests("--aggregated", "1"), "Deployment").values()
               if container(d).get("command", [""])[0] == "python"}
    modules |= {container(d)["command"][2] for d in by_kind(manifests(), "Deployment").values()
                if container(d).get("command", [""])[0] == "python"}
    assert modules == {"dynamo_pd.frontend", "dynamo_pd.aggregated", "dynamo_pd.prefill", "dynamo_pd.decode"}
    for module in modules:
        path = ROOT / Path(*module.split("."))
        assert path.with_suffix(".py").exists() or (path / "__main__.py").exists(), module
