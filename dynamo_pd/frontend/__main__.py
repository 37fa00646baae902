"""`python -m dynamo_pd.frontend`: the OpenAI-compatible HTTP server, a KV router per model its
workers register (dynamo_pd.frontend.gateway) and, unless etcd is given, the embedded discovery
server the workers register with.

With --frontend-processes N this process starts N - 1 more like it (they join its discovery instead of
hosting one) and all of them listen on the one port with SO_REUSEPORT, so the kernel spreads connections
over N event loops (N cores). Each has its own routers, fed by every worker's KV events and load reports;
their placements reach each other on the event plane (frontend.replicas), as separate frontends' do. The
siblings stop with this process (SIGTERM from it, and from the kernel if it dies)."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import signal
import socket
import subprocess
import sys

import uvicorn

from dynamo_pd import tracing
from dynamo_pd.cli import NAMESPACE_HELP, add_frontend_args, check_frontend_args, check_namespace, frontend_defaults
from dynamo_pd.credentials import add_api_key_args, add_security_args, api_key_from_args, security_from_args
from dynamo_pd.frontend.app import FrontendConfig, create_app
from dynamo_pd.frontend.backend import BackendConfig, RemoteBackend
from dynamo_pd.frontend.gateway import BackendFactory, Gateway, ModelView
from dynamo_pd.frontend.config import ConfigError, load
from dynamo_pd.frontend.gateway_metrics import GatewayMetrics
from dynamo_pd.frontend.tokenizer import load_tokenizer
from dynamo_pd.metrics import Metrics
from dynamo_pd.model_store import DEFAULT_MODEL, ModelNotFoundError, resolve_model
from dynamo_pd.runtime import DiscoveryServer, EventPlane, connect_discovery, connect_event_plane
from dynamo_pd.runtime.ports import advertise_host
from dynamo_pd.runtime.security import configure
from router.approx import ApproxKvRouter
from router.service import RouterConfig

log = logging.getLogger("dynamo_pd.frontend")

# An idle client connection stays open longer than clients keep theirs pooled (aiperf 300 s, aiohttp 15 s, a
# cloud load balancer's 60 s), so the client is the one that closes it: a server that closes first races the
# client's next request on that connection, which fails (uvicorn's default of 5 s lost aiperf requests sent on a
# connection idle for about 5 s: "Can not write request body", "Server disconnected").
HTTP_KEEP_ALIVE_S = 330


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dynamo_pd.frontend", description="dynamo-pd OpenAI frontend + router")
    p.add_argument("--host", default="127.0.0.1",
                   help="HTTP and ZMQ event plane bind address (default 127.0.0.1; 0.0.0.0: every interface)")
    p.add_argument("--advertise-host", default="",
                   help="address other frontends reach this one's event plane at (default: --host, or for 0.0.0.0 "
                        "this host's address on the route to discovery)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=None,
                   help=f"a model to load before its workers register (e.g. {DEFAULT_MODEL}); every model a worker "
                        "registers is served either way")
    p.add_argument("--discovery", default="tcp://127.0.0.1:7000",
                   help="etcd://HOST:PORT, or tcp://HOST:PORT where this frontend hosts embedded discovery")
    p.add_argument("--namespace", default="dynamo_pd", help=NAMESPACE_HELP)
    p.add_argument("--events", default=None, help="nats://HOST:PORT (default: ZMQ)")
    p.add_argument("--join-discovery", action="store_true", help=argparse.SUPPRESS)  # a sibling's: hosted elsewhere
    p.add_argument("--approx-kv-ttl-s", type=float, default=120.0,
                   help="workers that publish no KV events (--engine http): how long the router predicts a prompt "
                        "it routed there stays cached")
    add_api_key_args(p)
    add_frontend_args(p)
    add_security_args(p)
    tracing.add_args(p)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a sibling process is started with
    args.tracing = tracing.config_from_args(p, args)
    args.api_key = api_key_from_args(args)
    args.security = security_from_args(args)
    if not (args.discovery.startswith("tcp://") or args.discovery.startswith("etcd://")):
        p.error(f"--discovery must be etcd://HOST:PORT or tcp://HOST:PORT, got {args.discovery!r}")
    if args.events is not None and not args.events.startswith("nats://"):
        p.error(f"--events must be nats://HOST:PORT, got {args.events!r}")
    check_frontend_args(p, args)
    try:
        args.gateway = load(args.config, args, frontend_defaults())
    except ConfigError as exc:  # one line, before anything starts
        raise SystemExit(f"error: {exc}") from None
    return args


def backend_factory(args: argparse.Namespace, events: EventPlane, metrics: Metrics) -> BackendFactory:
    """How the gateway makes a model's backend: its tokenizer and context from the model's files, its router."""

    async def make(name: str, model_path: str, view: ModelView) -> RemoteBackend:
        tokenizer, context_len = await asyncio.to_thread(lambda: load_tokenizer(resolve_model(model_path or name)))
        router = ApproxKvRouter(RouterConfig(policy=args.router_policy,  # the block size: the workers' registration
                                             overlap_weight=args.overlap_weight, temperature=args.router_temperature,
                                             busy_kv_fraction=args.busy_kv_fraction),
                                approximate=view.approximate, ttl_s=args.approx_kv_ttl_s)
        backend = RemoteBackend(name, tokenizer, context_len, view, events, router, metrics,
                                BackendConfig(args.local_prefill_tokens, args.on_prefill_failure,
                                              args.inter_token_timeout_s, args.migration_limit),
                                namespace=args.namespace)
        await backend.start()
        return backend

    return make


async def run(args: argparse.Namespace) -> None:
    tracing.setup(args.tracing, "dynamo-pd-frontend")
    closers = []
    configure(args.security)  # every socket of this process: its RPC client, KV event readers, discovery
    if args.discovery.startswith("tcp://") and not args.join_discovery:
        server = DiscoveryServer(args.discovery)
        await server.start()
        closers.append(server.close)
    discovery = await connect_discovery(args.discovery, namespace=check_namespace(args.namespace))
    events = await connect_event_plane(args.events, discovery, host=args.host,
                                       advertise_host=advertise_host(args.host, args.advertise_host, args.discovery))
    metrics = Metrics()
    gateway = Gateway(discovery, backend_factory(args, events, metrics), GatewayMetrics(metrics), args.gateway)
    closers[:0] = [gateway.close, events.close, discovery.close]
    if args.model is not None:
        try:
            await gateway.add_model(args.model, args.model)
        except ModelNotFoundError as exc:
            raise SystemExit(f"error: {exc} (--model)") from None
    await gateway.start()
    app = create_app(gateway, FrontendConfig(host=args.host, port=args.port, api_key=args.api_key,
                                             max_body_bytes=args.max_body_bytes,
                                             tool_call_parser=args.tool_call_parser,
                                             reasoning_parser=args.reasoning_parser), metrics)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                           timeout_keep_alive=HTTP_KEEP_ALIVE_S, timeout_graceful_shutdown=5))
    shared = args.frontend_processes > 1 or args.join_discovery
    listening = listen(args.host, args.port, reuse_port=shared)
    siblings = start_siblings(args) if args.frontend_processes > 1 else []
    closers.insert(0, lambda: stop_siblings(siblings))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    loop.add_signal_handler(signal.SIGHUP, reload, args, gateway, siblings)
    print(f"dynamo-pd frontend listening on http://{args.host}:{args.port} (discovery {args.discovery})", flush=True)
    try:
        await server.serve(sockets=[listening])
    finally:
        for close in closers:
            await close()
        tracing.shutdown()  # what is still queued is exported


def listen(host: str, port: int, reuse_port: bool) -> socket.socket:
    """The HTTP socket; with `reuse_port`, one of several processes' sockets on this port."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"error: the frontend cannot listen on {host}:{port}: {exc} (--port)") from None
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def _die_with_parent() -> None:
    """In a sibling, before it runs: SIGTERM when the process that started it dies (Linux's PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def start_siblings(args: argparse.Namespace) -> list[subprocess.Popen]:
    """--frontend-processes - 1 more frontends on this port, joining this one's discovery (started already)."""
    argv = [sys.executable, "-m", "dynamo_pd.frontend", *args.argv, "--frontend-processes", "1", "--join-discovery"]
    return [subprocess.Popen(argv, preexec_fn=_die_with_parent) for _ in range(args.frontend_processes - 1)]


async def stop_siblings(siblings: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    for proc in siblings:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in siblings:
        try:
            await asyncio.to_thread(proc.wait, grace_s)
        except subprocess.TimeoutExpired:
            log.warning("frontend process %d still running %gs after SIGTERM: killed", proc.pid, grace_s)
            proc.kill()
            await asyncio.to_thread(proc.wait)


def reload(args: argparse.Namespace, gateway: Gateway, siblings: list[subprocess.Popen]) -> None:
    """SIGHUP: the configuration file again (and the flags over it); a bad one changes nothing. Each
    sibling process reads it too."""
    for proc in siblings:
        proc.send_signal(signal.SIGHUP)
    try:
        config = load(args.config, args, frontend_defaults())
    except ConfigError as exc:
        log.error("reload refused, the configuration in force stays: %s", exc)
        return
    gateway.apply(config)
    log.info("configuration reloaded from %s", args.config or "the flags")


def main(argv: list[str] | None = None) -> None:
    import uvloop

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    uvloop.run(run(parse_args(argv)))


if __name__ == "__main__":
    main()
