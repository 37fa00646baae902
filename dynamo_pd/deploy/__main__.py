"""`python -m dynamo_pd.deploy k8s --prefill N --decode M --engine E ...`: a deployment's Kubernetes
manifests on standard output (dynamo_pd/deploy/k8s.py says what they hold). Flags this command does not
know go to every worker as given (`--model`, `--block-size`, an engine's own flags), as `serve` passes
them; the frontend's options (`--router-policy`, `--config gateway.toml`, ...) go to the frontend."""

from __future__ import annotations

import argparse
import re
import sys

import yaml

from dynamo_pd.cli import (NAMESPACE_HELP, add_frontend_args, add_kv_args, check_frontend_args,
                           check_namespace, frontend_argv, frontend_defaults, parse_passthrough)
from dynamo_pd.credentials import read_secret
from dynamo_pd.deploy.k8s import ENGINES, GPU_ENGINES, K8sPlan, Resources, SecretRef, render
from dynamo_pd.runtime.security import SecretError, Security

_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # a DNS-1035 label: Service names must be one
_QUANTITY = re.compile(r"\d+(\.\d+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?")
_CPU = re.compile(r"\d+(\.\d+)?m?")  # cores, or millicores
_LONGEST_SUFFIX = len("-aggregated")


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The command's parser and its k8s subcommand's (whose errors name the subcommand)."""
    parser = argparse.ArgumentParser(prog="python -m dynamo_pd.deploy", description="Deployment manifests.")
    targets = parser.add_subparsers(dest="target", required=True)
    k8s = targets.add_parser("k8s", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                             help="Kubernetes manifests (kubectl apply -f -)", allow_abbrev=False)
    k8s.add_argument("--prefill", type=int, default=None, help="prefill workers (default 1)")
    k8s.add_argument("--decode", type=int, default=None, help="decode workers (default 1)")
    k8s.add_argument("--aggregated", type=int, default=0,
                     help="aggregated workers (instead of prefill/decode)")
    k8s.add_argument("--engine", default="native", choices=ENGINES,
                     help=f"the workers' engine; {', '.join(GPU_ENGINES)} get --gpus-per-worker GPUs")
    k8s.add_argument("--name", default=K8sPlan.name,
                     help="prefix of every object's name (default %(default)s)")
    k8s.add_argument("--k8s-namespace", default=K8sPlan.k8s_namespace,
                     help="the Kubernetes namespace (default %(default)s; the manifests create it)")
    k8s.add_argument("--namespace", default=K8sPlan.namespace, help=NAMESPACE_HELP)
    k8s.add_argument("--image", default=K8sPlan.image,
                     help="the image the Dockerfile builds (default %(default)s)")
    k8s.add_argument("--image-pull-policy", default=K8sPlan.image_pull_policy,
                     choices=["Always", "IfNotPresent", "Never"])
    k8s.add_argument("--frontend-replicas", type=int, default=K8sPlan.frontend_replicas)
    k8s.add_argument("--gpus-per-worker", type=int, default=None,
                     help="nvidia.com/gpu per worker (default 1 for GPU engines, else 0; native with GPUs "
                          "runs --device cuda)")
    k8s.add_argument("--worker-cpu", default=None, help="CPU request per worker (default 2; 8 with GPUs)")
    k8s.add_argument("--worker-memory", default=None, help="memory per worker (default 8Gi; 32Gi with GPUs)")
    k8s.add_argument("--frontend-cpu", default=K8sPlan.frontend.cpu)
    k8s.add_argument("--frontend-memory", default=K8sPlan.frontend.memory)
    k8s.add_argument("--shm-size", default=K8sPlan.shm_size,
                     help="each worker's /dev/shm (default %(default)s)")
    k8s.add_argument("--drain-timeout-s", type=float, default=K8sPlan.drain_timeout_s,
                     help="how long a worker's in-flight requests may finish on SIGTERM before they move; "
                          "the pods' termination grace is this plus 15 s (default %(default)s)")
    add_kv_args(k8s)
    k8s.add_argument("--etcd", default=None, help="etcd://HOST:PORT that exists (default: deploy one)")
    k8s.add_argument("--nats", default=None, help="nats://HOST:PORT that exists (default: deploy one)")
    k8s.add_argument("--etcd-image", default=K8sPlan.etcd_image)
    k8s.add_argument("--nats-image", default=K8sPlan.nats_image)
    secrets = k8s.add_mutually_exclusive_group()
    secrets.add_argument("--cluster-secret-file", default=None,
                         help="a file holding the cluster secret: rendered into the Secret <name>-secrets")
    secrets.add_argument("--cluster-secret-ref", default=None, metavar="SECRET:KEY",
                         help="the cluster secret is KEY of the Secret SECRET, which exists in the namespace")
    keys = k8s.add_mutually_exclusive_group()
    keys.add_argument("--api-key-file", default=None,
                      help="a file holding the frontend's API key: rendered into the Secret <name>-secrets")
    keys.add_argument("--api-key-ref", default=None, metavar="SECRET:KEY",
                      help="the API key is KEY of the Secret SECRET, which exists in the namespace")
    k8s.add_argument("--service-type", default=K8sPlan.service_type,
                     choices=["ClusterIP", "NodePort", "LoadBalancer"], help="the frontend's Service")
    k8s.add_argument("--service-monitor", action="store_true",
                     help="a ServiceMonitor (Prometheus Operator) besides the pods' scrape annotations")
    k8s.add_argument("--model-cache-pvc", default=None,
                     help="a PersistentVolumeClaim (ReadWriteMany) for the workers' model cache (default: "
                          "an emptyDir per pod: each pod fetches the model)")
    add_frontend_args(k8s)
    return parser, k8s


def _fail(flag: str, message: str) -> SystemExit:
    return SystemExit(f"error: {flag}: {message}")


def _ref(flag: str, value: str | None) -> SecretRef | None:
    if value is None:
        return None
    name, _, key = value.partition(":")
    if not _NAME.fullmatch(name) or not re.fullmatch(r"[-._a-zA-Z0-9]+", key):
        raise _fail(flag, f"expected SECRET:KEY (a Secret's name and one of its keys), got {value!r}")
    return SecretRef(name, key)


def _quantity(flag: str, value: str) -> str:
    pattern, examples = (_CPU, "2 or 500m") if flag.endswith("-cpu") else (_QUANTITY, "8Gi or 512Mi")
    if not pattern.fullmatch(value) or not float(re.sub(r"[a-zA-Z]+$", "", value)) > 0:
        raise _fail(flag, f"expected a positive Kubernetes quantity such as {examples}, got {value!r}")
    return value


def _gateway_toml(args: argparse.Namespace) -> str | None:
    """The --config file's text, checked as the frontend checks it (the frontend's flags over it)."""
    if args.config is None:
        return None
    from dynamo_pd.frontend.config import ConfigError, load

    try:
        load(args.config, args, frontend_defaults())
        with open(args.config) as f:
            return f.read()
    except (ConfigError, OSError) as exc:
        raise _fail("--config", str(exc)) from None


def plan_from_args(argv: list[str] | None = None) -> K8sPlan:
    parser, k8s = _parsers()
    args, worker_args = parser.parse_known_args(argv)
    if args.aggregated and (args.prefill or args.decode):
        k8s.error("--aggregated cannot be combined with --prefill/--decode")
    if args.aggregated < 0:
        k8s.error(f"--aggregated must be >= 1, got {args.aggregated}")
    prefill = 1 if args.prefill is None else args.prefill
    decode = 1 if args.decode is None else args.decode
    if not args.aggregated and (prefill < 0 or decode < 1):
        k8s.error(f"--decode must be >= 1 and --prefill >= 0, got --prefill {prefill} --decode {decode}")
    if args.frontend_replicas < 1:
        k8s.error(f"--frontend-replicas must be >= 1, got {args.frontend_replicas}")
    if args.drain_timeout_s < 0:
        k8s.error(f"--drain-timeout-s must be >= 0, got {args.drain_timeout_s}")
    check_frontend_args(k8s, args)
    check_namespace(args.namespace)
    for flag, value in (("--name", args.name), ("--k8s-namespace", args.k8s_namespace)):
        longest = 63 - (_LONGEST_SUFFIX if flag == "--name" else 0)
        if not _NAME.fullmatch(value) or len(value) > longest:
            raise _fail(flag, f"expected lowercase letters, digits and '-', starting with a letter, at most "
                              f"{longest} characters, got {value!r}")
    for flag, value, scheme in (("--etcd", args.etcd, "etcd://"), ("--nats", args.nats, "nats://")):
        if value is not None and not re.fullmatch(re.escape(scheme) + r"[^/:\s]+:\d+", value):
            raise _fail(flag, f"expected {scheme}HOST:PORT, got {value!r}")
    parse_passthrough(worker_args)  # `--name value` pairs, or one line naming what is not
    gpus = args.gpus_per_worker if args.gpus_per_worker is not None else int(args.engine in GPU_ENGINES)
    if gpus < 0 or (args.engine in GPU_ENGINES and gpus < 1):
        raise _fail("--gpus-per-worker", f"{args.engine} needs at least 1 GPU per worker, got {gpus}"
                    if gpus >= 0 else f"must be >= 0, got {gpus}")
    cluster_secret: str | SecretRef | None = _ref("--cluster-secret-ref", args.cluster_secret_ref)
    if args.cluster_secret_file is not None:
        cluster_secret = read_secret(args.cluster_secret_file, "", "--cluster-secret-file")
        try:
            Security(cluster_secret)  # too short a secret fails here, not in every pod
        except SecretError as exc:
            raise _fail("--cluster-secret-file", str(exc)) from None
    api_key: str | SecretRef | None = _ref("--api-key-ref", args.api_key_ref)
    if args.api_key_file is not None:
        api_key = read_secret(args.api_key_file, "", "--api-key-file")
    gateway_toml = _gateway_toml(args)
    args.config = None  # the frontend reads the ConfigMap's copy
    return K8sPlan(
        prefill=prefill, decode=decode, aggregated=args.aggregated, engine=args.engine, name=args.name,
        k8s_namespace=args.k8s_namespace, namespace=args.namespace, image=args.image,
        image_pull_policy=args.image_pull_policy, frontend_replicas=args.frontend_replicas,
        worker=Resources(_quantity("--worker-cpu", args.worker_cpu or ("8" if gpus else "2")),
                         _quantity("--worker-memory", args.worker_memory or ("32Gi" if gpus else "8Gi")),
                         gpus),
        frontend=Resources(_quantity("--frontend-cpu", args.frontend_cpu),
                           _quantity("--frontend-memory", args.frontend_memory)),
        drain_timeout_s=args.drain_timeout_s, kv_transport=args.kv_transport, kv_handoff=args.kv_handoff,
        etcd=args.etcd, nats=args.nats, etcd_image=args.etcd_image, nats_image=args.nats_image,
        gateway_toml=gateway_toml, cluster_secret=cluster_secret, api_key=api_key,
        service_type=args.service_type,
        service_monitor=args.service_monitor, model_cache_pvc=args.model_cache_pvc,
        shm_size=_quantity("--shm-size", args.shm_size), worker_args=tuple(worker_args),
        frontend_args=tuple(frontend_argv(args)),
    )


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data) -> bool:  # objects share label dicts: print each in full, no &id001
        return True


def to_yaml(docs: list[dict]) -> str:
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False)


def main(argv: list[str] | None = None) -> None:
    plan = plan_from_args(argv)
    if plan.cluster_secret is None:
        print("dynamo-pd deploy: no --cluster-secret-file or --cluster-secret-ref: the ZMQ planes between "
              "pods are plain (no CURVE)", file=sys.stderr)
    sys.stdout.write(to_yaml(render(plan)))


if __name__ == "__main__":
    main()
