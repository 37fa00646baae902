"""`python -m dynamo_pd.serve`: a whole deployment on this machine, with one command.

    python -m dynamo_pd.serve --prefill 1 --decode 1          # disaggregated (the default)
    python -m dynamo_pd.serve --aggregated 2                  # aggregated workers only

Starts the frontend (which hosts discovery and the router) and the workers as child processes,
reports when every worker has registered, and on Ctrl-C / SIGTERM stops them all. Engine flags
(`--engine`, `--model`, `--block-size`, ... and any engine-specific ones) go to every worker.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time

from dynamo_pd.cli import NAMESPACE_HELP, add_engine_args, add_kv_args, check_namespace, engine_config
from dynamo_pd.engines.base import EngineRole
from dynamo_pd.model_store import ModelFetchError, ModelNotFoundError, resolve_model

_READY_TIMEOUT_S = 600.0
_STOP_GRACE_S = 10.0


def _serve_parser(add_help: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dynamo_pd.serve", description="Start a dynamo-pd deployment.",
                                add_help=add_help, allow_abbrev=False)
    p.add_argument("--prefill", type=int, default=None, help="prefill workers (default 1)")
    p.add_argument("--decode", type=int, default=None, help="decode workers (default 1)")
    p.add_argument("--aggregated", type=int, default=0, help="aggregated workers (instead of prefill/decode)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--discovery-port", type=int, default=7000, help="embedded discovery port (ignored with --etcd)")
    p.add_argument("--etcd", default=None, help="etcd://HOST:PORT for discovery instead of the embedded one")
    p.add_argument("--namespace", default="dynamo_pd", help=NAMESPACE_HELP)
    p.add_argument("--nats", default=None, help="nats://HOST:PORT for the event plane instead of ZMQ")
    add_kv_args(p)
    p.add_argument("--api-key", default=None, help="require this Bearer key on the HTTP API")
    return p


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The launcher's options (engine flags included, for --help and validation) and the engine
    flags exactly as given, which every worker receives untouched."""
    p = _serve_parser()
    add_engine_args(p)
    args, passthrough = p.parse_known_args(argv)
    if args.aggregated and (args.prefill or args.decode):
        p.error("--aggregated cannot be combined with --prefill/--decode")
    if not args.aggregated:
        args.prefill = 1 if args.prefill is None else args.prefill
        args.decode = 1 if args.decode is None else args.decode
        if args.prefill < 0 or args.decode < 1:
            p.error(f"--decode must be >= 1 and --prefill >= 0, got --prefill {args.prefill} --decode {args.decode}")
    elif args.aggregated < 0:
        p.error(f"--aggregated must be >= 1, got {args.aggregated}")
    check_namespace(args.namespace)
    engine_config(args, EngineRole.AGGREGATED, passthrough)  # validates engine flags before anything starts
    _, engine_argv = _serve_parser(add_help=False).parse_known_args(argv)
    return args, engine_argv


def plan(args: argparse.Namespace, engine_argv: list[str]) -> tuple[str, list[list[str]]]:
    """The discovery URL and the command line of every child: frontend first, then workers."""
    discovery = args.etcd or f"tcp://127.0.0.1:{args.discovery_port}"
    plane = ["--namespace", args.namespace] + (["--events", args.nats] if args.nats else [])
    frontend = [sys.executable, "-m", "dynamo_pd.frontend", "--host", args.host, "--port", str(args.port),
                "--discovery", discovery, "--block-size", str(args.block_size), *plane]
    if args.model:
        frontend += ["--model", args.model]
    if args.api_key:
        frontend += ["--api-key", args.api_key]
    roles = [("aggregated", args.aggregated)] if args.aggregated else [("prefill", args.prefill), ("decode", args.decode)]
    workers = [
        [sys.executable, "-m", f"dynamo_pd.{role}", "--discovery", discovery, "--kv-transport", args.kv_transport,
         "--kv-handoff", args.kv_handoff, "--worker-id", f"{role}-{i}", *plane, *engine_argv]
        for role, count in roles for i in range(count)
    ]
    return discovery, [frontend, *workers]


async def _wait_ready(discovery_url: str, namespace: str, expected: int, children: list[subprocess.Popen]) -> None:
    from dynamo_pd.runtime import connect_discovery

    deadline = time.monotonic() + _READY_TIMEOUT_S
    discovery = None
    seen = -1
    try:
        while time.monotonic() < deadline:
            for child in children:
                if child.poll() is not None:
                    raise SystemExit(f"error: {' '.join(child.args[1:4])} exited with code {child.returncode}")
            try:
                discovery = discovery or await connect_discovery(discovery_url, namespace=namespace)
                registered = len(await discovery.list())
            except Exception:  # noqa: BLE001 - the frontend hosting discovery may still be starting
                registered = 0
            if registered != seen:
                print(f"dynamo-pd: {registered}/{expected} workers registered", flush=True)
                seen = registered
            if registered >= expected:
                return
            await asyncio.sleep(0.5)
        raise SystemExit(f"error: workers not ready within {_READY_TIMEOUT_S:.0f}s")
    finally:
        if discovery is not None:
            await discovery.close()


def _stop(children: list[subprocess.Popen]) -> None:
    for child in reversed(children):  # workers first, the frontend (and discovery) last
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _STOP_GRACE_S
    for child in children:
        try:
            child.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _watch(children: list[subprocess.Popen]) -> None:
    """Serve until the frontend exits; a worker that dies is reported and the rest keep serving
    (discovery drops it within its lease TTL, and the router stops sending it work)."""
    frontend, workers = children[0], children[1:]
    reported: set[int] = set()
    while frontend.poll() is None:
        for worker in workers:
            if worker.poll() is not None and worker.pid not in reported:
                reported.add(worker.pid)
                print(f"dynamo-pd: worker {worker.args[worker.args.index('--worker-id') + 1]} exited with code "
                      f"{worker.returncode}; the others keep serving", flush=True)
        time.sleep(0.5)
    raise SystemExit(f"error: the frontend exited with code {frontend.returncode}; stopping")


def main(argv: list[str] | None = None) -> None:
    args, engine_argv = parse_args(argv)
    try:
        resolve_model(args.model)  # fetch / convert once, with progress, before any worker starts
    except (ModelNotFoundError, ModelFetchError) as exc:
        raise SystemExit(f"error: {exc}") from None
    discovery_url, commands = plan(args, engine_argv)
    env = dict(os.environ)
    # Workers share the cores; without this every process spawns a thread per core and they thrash.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, len(commands) - 1))))
    children: list[subprocess.Popen] = []

    def on_signal(_signum, _frame) -> None:
        # The first Ctrl-C / SIGTERM stops everything; a second one (a terminal signals the whole
        # process group, so it often comes at once) must not cut that shutdown short.
        _ignore_signals()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        for command in commands:
            children.append(subprocess.Popen(command, env=env))
        asyncio.run(_wait_ready(discovery_url, args.namespace, len(commands) - 1, children))
        print(f"dynamo-pd ready: OpenAI API at http://{args.host}:{args.port}/v1 "
              f"({' + '.join(' '.join(c[2].split('.')[-1:]) for c in commands[1:])}); Ctrl-C stops", flush=True)
        _watch(children)
    except KeyboardInterrupt:
        print("dynamo-pd: stopping", flush=True)
    finally:
        _ignore_signals()
        _stop(children)


def _ignore_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


if __name__ == "__main__":
    main()
