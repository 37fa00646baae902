"""`python -m dynamo_pd.planner`: the planner beside a deployment on Kubernetes (its workers run there).

    python -m dynamo_pd.planner --discovery etcd://etcd:2379 --events nats://nats:4222 \\
        --k8s-namespace dynamo-pd --k8s-name dynamo-pd --ttft-slo 500 --itl-slo 20 --budget 12

It reads the deployment's planes (dynamo_pd.planner.observe) and scales the Deployments
`python -m dynamo_pd.deploy k8s` renders, `<k8s-name>-prefill` and `<k8s-name>-decode` (or
`<k8s-name>-aggregated` with --aggregated), with the `<k8s-name>-planner` ServiceAccount's rights.
On one host, `python -m dynamo_pd.serve --planner` runs it with the local connector instead.
"""

from __future__ import annotations

import argparse
import logging

from dynamo_pd.cli import NAMESPACE_HELP, check_namespace
from dynamo_pd.credentials import add_security_args, security_from_args
from dynamo_pd.planner.config import (AGGREGATED, DISAGGREGATED, PlannerConfig, add_planner_args,
                                      planner_config)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, PlannerConfig]:
    p = argparse.ArgumentParser(prog="python -m dynamo_pd.planner", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--discovery", required=True, help="etcd://HOST:PORT (or tcp://HOST:PORT, embedded)")
    p.add_argument("--namespace", default="dynamo_pd", help=NAMESPACE_HELP)
    p.add_argument("--events", default=None, help="nats://HOST:PORT for the event plane (default: ZMQ)")
    p.add_argument("--aggregated", action="store_true",
                   help="plan one aggregated pool (default: prefill and decode)")
    p.add_argument("--max-num-batched-tokens", type=int, default=PlannerConfig.chunk_tokens,
                   help="the workers' prefill tokens per step, as they were started (default %(default)s)")
    p.add_argument("--metrics-host", default="0.0.0.0", help="where /metrics listens (default %(default)s)")
    p.add_argument("--metrics-port", type=int, default=9100, help="its port (default %(default)s)")
    k8s = p.add_argument_group("Kubernetes")
    k8s.add_argument("--k8s-namespace", default="dynamo-pd",
                     help="the deployment's namespace (default %(default)s)")
    k8s.add_argument("--k8s-name", default="dynamo-pd",
                     help="its name, as `python -m dynamo_pd.deploy k8s --name` (default %(default)s)")
    k8s.add_argument("--kubeconfig", default=None,
                     help="outside a pod: this kubeconfig (default ~/.kube/config)")
    k8s.add_argument("--kube-context", default=None, help="and this context in it (default its current one)")
    add_security_args(p)
    add_planner_args(p)
    args = p.parse_args(argv)
    check_namespace(args.namespace)
    args.security = security_from_args(args)
    return args, planner_config(p, args, AGGREGATED if args.aggregated else DISAGGREGATED,
                                args.max_num_batched_tokens)


async def run(args: argparse.Namespace, config: PlannerConfig) -> None:
    from dynamo_pd.planner.app import plan, planes
    from dynamo_pd.planner.connectors.kubernetes import connect

    connector = await connect(args.k8s_namespace, args.k8s_name, config.pools, args.kubeconfig,
                              args.kube_context)
    try:
        async with planes(args.discovery, args.namespace, args.events, args.security) as (discovery, events):
            await plan(config, connector, discovery, events, args.namespace, args.metrics_host,
                       args.metrics_port)
    finally:
        await connector.close()


def main(argv: list[str] | None = None) -> None:
    import uvloop

    from dynamo_pd.runtime.security import configure

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args, config = parse_args(argv)
    configure(args.security)
    uvloop.run(run(args, config))


if __name__ == "__main__":
    main()
