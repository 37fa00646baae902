"""`python -m dynamo_pd.serve`: a whole deployment on this machine, with one command.

    python -m dynamo_pd.serve --prefill 1 --decode 1          # disaggregated (the default)
    python -m dynamo_pd.serve --aggregated 2                  # aggregated workers only

Starts the frontend (which hosts discovery and the router) and the workers as child processes,
reports when every worker has registered, and on Ctrl-C / SIGTERM stops them all. Engine flags
(`--engine`, `--model`, `--block-size`, ... and any engine-specific ones) go to every worker; the
workers share this host's memory, so a fraction of it (`--gpu-memory-utilization`, which vLLM on
CPU applies to host memory) is split between them, while `--kv-cache-memory-gb` is per worker.
Each child logs to a file; a child that fails to start is reported in one line: its cause, the
flag to change and the log's path.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from dynamo_pd.cli import (NAMESPACE_HELP, add_engine_args, add_frontend_args, add_kv_args,
                           check_frontend_args, check_namespace, engine_config, frontend_argv,
                           parse_passthrough)
from dynamo_pd.credentials import (API_KEY_ENV, add_api_key_args, add_security_args, api_key_from_args,
                                   security_argv, security_from_args)
from dynamo_pd.engines.base import EngineRole, engine_entry
from dynamo_pd.model_store import ModelFetchError, ModelNotFoundError, resolve_model
from dynamo_pd.planner.config import AGGREGATED, DISAGGREGATED, add_planner_args, planner_config
from dynamo_pd.runtime.security import configure
from dynamo_pd import tracing

_READY_TIMEOUT_S = 600.0
_STOP_GRACE_S = 10.0
T = TypeVar("T")


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
    add_api_key_args(p)
    add_security_args(p)
    p.add_argument("--pin-cores", action="store_true",
                   help="pin each worker to its own equal share of this process's cores (benchmarks: every "
                        "configuration of N workers gets the same compute); mocker workers are not pinned")
    p.add_argument("--prometheus-config", default=None, metavar="PATH",
                   help="once ready, write a Prometheus configuration scraping every process here "
                        "(docs/operations/metrics.md)")
    p.add_argument("--planner", action="store_true",
                   help="size the pools from live load (docs/planner.md): --prefill/--decode/--aggregated "
                        "are the counts to start with, the planner's flags below the rest (no --pin-cores)")
    add_planner_args(p)
    add_frontend_args(p)
    tracing.add_args(p)  # the frontend and every worker get the same
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
    check_frontend_args(p, args)
    args.tracing = tracing.config_from_args(p, args)
    if args.planner:
        args.planner_config = cfg = planner_config(p, args, AGGREGATED if args.aggregated else DISAGGREGATED,
                                                   args.max_num_batched_tokens)
        for pool, count in initial_counts(args).items():
            if not cfg.min_workers(pool) <= count <= cfg.max_workers(pool):
                p.error(f"--{pool} {count} is outside the planner's "
                        f"{cfg.min_workers(pool)}..{cfg.max_workers(pool)}")
        if worker_count(args) > cfg.budget:
            p.error(f"{worker_count(args)} workers to start with exceed --budget {cfg.budget}")
    args.api_key = api_key_from_args(args)  # to the frontend in its environment, never in its argv
    args.security = security_from_args(args)
    engine_config(args, EngineRole.AGGREGATED, passthrough)  # validates engine flags before anything starts
    args.memory_fraction = parse_passthrough(passthrough).get("gpu_memory_utilization")
    _, engine_argv = _serve_parser(add_help=False).parse_known_args(argv)
    return args, engine_argv


def plan(args: argparse.Namespace, engine_argv: list[str]) -> tuple[str, list[list[str]]]:
    """The discovery URL and the command line of every child: frontend first, then workers (with
    --planner, the frontend alone: the planner's local connector starts workers through the hooks below)."""
    discovery = _discovery_url(args)
    frontend = [sys.executable, "-m", "dynamo_pd.frontend", "--host", args.host, "--port", str(args.port),
                "--discovery", discovery, *_plane(args)]
    if args.model:
        frontend += ["--model", args.model]
    frontend += frontend_argv(args)
    if args.planner:
        return discovery, [frontend]
    roles = initial_counts(args).items()
    if engine_entry(args.engine).shares_process:  # its workers compute nothing: each role's share one process
        workers = [pool_command(args, engine_argv, role, n) for role, n in roles if n]
    else:
        workers = [worker_command(args, engine_argv, role, f"{role}-{i}")
                   for role, n in roles for i in range(n)]
    return discovery, [frontend, *workers]


def initial_counts(args: argparse.Namespace) -> dict[str, int]:
    if args.aggregated:
        return {"aggregated": args.aggregated}
    return {"prefill": args.prefill, "decode": args.decode}


def _discovery_url(args: argparse.Namespace) -> str:
    return args.etcd or f"tcp://127.0.0.1:{args.discovery_port}"


def _plane(args: argparse.Namespace) -> list[str]:
    return ["--namespace", args.namespace, *(["--events", args.nats] if args.nats else []),
            *security_argv(args), *tracing.argv(args.tracing)]


def _worker_common(args: argparse.Namespace) -> list[str]:
    return ["--discovery", _discovery_url(args), "--kv-transport", args.kv_transport, "--kv-handoff",
            args.kv_handoff, *_plane(args)]


def worker_command(args: argparse.Namespace, engine_argv: list[str], role: str, worker_id: str) -> list[str]:
    """One worker process's command line (the launcher's hook for starting a worker)."""
    # Every worker runs on this host: a fraction of its memory is the deployment's, split evenly between
    # as many workers as it may have (the last --gpu-memory-utilization on a worker's command line wins).
    count = args.planner_config.budget if args.planner else worker_count(args)
    share = []
    if args.memory_fraction:
        share += ["--gpu-memory-utilization", f"{args.memory_fraction / count:.4g}"]
    if args.kv_cache_memory_fraction:  # the workers start together and see the same free memory
        share += ["--kv-cache-memory-fraction", f"{args.kv_cache_memory_fraction / count:.4g}"]
    return [sys.executable, "-m", f"dynamo_pd.{role}", "--worker-id", worker_id, *_worker_common(args),
            *engine_argv, *share]


def pool_command(args: argparse.Namespace, engine_argv: list[str], role: str, workers: int,
                 control: bool = False) -> list[str]:
    """The command line of one process holding a role's workers, for engines that share one (the mocker);
    `control`: it takes add / drain commands for single workers (the planner's local connector)."""
    return [sys.executable, "-m", "dynamo_pd.mocker", "--workers", str(workers), "--role", role,
            "--worker-id", role, *(["--control"] if control else []), *_worker_common(args), *engine_argv]


def core_sets(workers: int, cores: list[int]) -> list[list[int]]:
    """Each worker its own equal share of the cores (workers beyond the cores share them in turn)."""
    share = max(1, len(cores) // workers)
    return [[cores[(i * share + j) % len(cores)] for j in range(share)] for i in range(workers)]


def worker_count(args: argparse.Namespace) -> int:
    return args.aggregated or args.prefill + args.decode


def child_name(command: list[str]) -> str:
    return command[command.index("--worker-id") + 1] if "--worker-id" in command else "frontend"


def check_ports_free(args: argparse.Namespace) -> None:
    """Two deployments on one host must differ in --port and --discovery-port: say so before starting."""
    ports = [("--port", args.host, args.port)] + ([] if args.etcd else [("--discovery-port", "127.0.0.1",
                                                                        args.discovery_port)])
    for flag, host, port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind it
            try:
                s.bind((host, port))
            except OSError as exc:
                raise SystemExit(f"error: {host}:{port} is taken ({exc.strerror}; another deployment?): "
                                 f"choose another {flag}") from None


# A failed child's error line -> the flag that fixes it (first match wins).
_FIXES = (
    (re.compile(r"utilization", re.I), "--gpu-memory-utilization"),
    (re.compile(r"memory", re.I), "--kv-cache-memory-gb"),
    (re.compile(r"address already in use", re.I), "--port or --discovery-port"),
    (re.compile(r"max_model_len", re.I), "--max-model-len"),
)
_ERROR_LINE = re.compile(r"(\w*(?:Error|Exception)|\berror)\b:\s", re.I)


def failure_line(name: str, code: int | None, log: Path) -> str:
    """One line for a child that exited before the deployment was ready: its cause and what to change."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line[m.start():] for line in lines if (m := _ERROR_LINE.search(line))]  # no log-line prefix
    # vLLM's front process re-raises its engine's root cause as a generic error: prefer a line we can act on
    fixable = [(line, flag) for line in errors for pattern, flag in _FIXES if pattern.search(line)]
    cause, flag = fixable[0] if fixable else ((errors or lines or [f"exit code {code}"])[-1], None)
    cause = cause[:300] + ("..." if len(cause) > 300 else "")
    what = "worker " + name if name != "frontend" else "the frontend"
    return f"error: {what} failed to start: {cause} ({f'change {flag}; ' if flag else ''}log: {log})"


async def _wait_ready(discovery_url: str, namespace: str, expected: int, children: list[subprocess.Popen],
                      log_dir: Path) -> list:
    """The registered workers' WorkerInfo, once `expected` have registered."""
    from dynamo_pd.protocol import WorkerInfo
    from dynamo_pd.runtime import connect_discovery

    deadline = time.monotonic() + _READY_TIMEOUT_S
    discovery = None
    seen = -1
    try:
        while time.monotonic() < deadline:
            for child in children:
                if child.poll() is not None:
                    name = child_name(child.args)
                    raise SystemExit(failure_line(name, child.returncode, log_dir / f"{name}.log"))
            try:
                discovery = discovery or await connect_discovery(discovery_url, namespace=namespace)
                infos = await discovery.list(WorkerInfo)
            except Exception:  # noqa: BLE001 - the frontend hosting discovery may still be starting
                infos = []
            registered = len(infos)
            if registered != seen:
                print(f"dynamo-pd: {registered}/{expected} workers registered", flush=True)
                seen = registered
            if registered >= expected:
                return infos
            await asyncio.sleep(0.5)
        raise SystemExit(f"error: workers not ready within {_READY_TIMEOUT_S:.0f}s (logs in {log_dir})")
    finally:
        if discovery is not None:
            await discovery.close()


def stop_children(children: list[subprocess.Popen], grace_s: float = _STOP_GRACE_S) -> None:
    """SIGTERM workers first, the frontend (and discovery) last; kill what outlives `grace_s`, with
    the processes it started (vLLM's EngineCore outlives a worker killed while its engine starts)."""
    for child in reversed(children):
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            below = descendants(child.pid)  # before the kill: after it they belong to init
            child.kill()
            for pid in below:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            child.wait()


def descendants(pid: int) -> list[int]:
    """The processes below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # "pid (comm) state ppid ..."
            children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


async def _unless_stopped(work: Coroutine[Any, Any, T], stop: threading.Event) -> T:
    """`work`'s result, or KeyboardInterrupt within 0.5 s of `stop` being set (as _watch: the readiness wait and
    the planner's serving see a stop whose KeyboardInterrupt Python swallowed). `work` runs in this task, so
    what it raises (SystemExit naming a failed worker) leaves asyncio.run as it would without this."""
    task = asyncio.current_task()

    async def watch() -> None:
        while not stop.is_set():
            await asyncio.sleep(0.5)
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if stop.is_set():
            raise KeyboardInterrupt from None
        raise
    finally:
        watcher.cancel()


def _watch(children: list[subprocess.Popen], log_dir: Path, stop: threading.Event) -> None:
    """Serve until the frontend exits or `stop` is set (KeyboardInterrupt); a worker that dies is reported and
    the rest keep serving (discovery drops it within its lease TTL, and the router stops sending it work)."""
    frontend, workers = children[0], children[1:]
    reported: set[int] = set()
    while frontend.poll() is None:
        if stop.is_set():  # the signal handler's KeyboardInterrupt was swallowed (raised in a weakref callback)
            raise KeyboardInterrupt
        for worker in workers:
            if worker.poll() is not None and worker.pid not in reported:
                reported.add(worker.pid)
                name = child_name(worker.args)
                print(f"dynamo-pd: worker {name} exited with code {worker.returncode} (log: {log_dir / name}.log); "
                      f"the others keep serving", flush=True)
        stop.wait(0.5)
    raise SystemExit(f"error: the frontend exited with code {frontend.returncode} (log: {log_dir}/frontend.log); "
                     f"stopping")


def main(argv: list[str] | None = None) -> None:
    args, engine_argv = parse_args(argv)
    check_ports_free(args)
    try:
        resolve_model(args.model)  # fetch / convert once, with progress, before any worker starts
    except (ModelNotFoundError, ModelFetchError) as exc:
        raise SystemExit(f"error: {exc}") from None
    discovery_url, commands = plan(args, engine_argv)
    log_dir = Path(tempfile.mkdtemp(prefix="dynamo-pd-logs-"))
    print(f"dynamo-pd: logs in {log_dir}", flush=True)
    if args.memory_fraction:
        print(f"dynamo-pd: {worker_count(args)} workers share --gpu-memory-utilization {args.memory_fraction}",
              flush=True)
    env = dict(os.environ, **({API_KEY_ENV: args.api_key} if args.api_key else {}))
    # Workers share the cores; without this every process spawns a thread per core and they thrash.
    most = args.planner_config.budget if args.planner else len(commands) - 1
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, most))))
    pins: list[list[int] | None] = [None] * len(commands)
    if args.pin_cores and engine_entry(args.engine).pinned and not args.planner:
        pins[1:] = core_sets(len(commands) - 1, sorted(os.sched_getaffinity(0)))
    children: list[subprocess.Popen] = []
    stop = threading.Event()

    def on_signal(_signum, _frame) -> None:
        # The first Ctrl-C / SIGTERM stops everything; a second one (a terminal signals the whole
        # process group, so it often comes at once) must not cut that shutdown short. The exception can
        # land where Python ignores it (a weakref callback of an import): `stop` is seen by the waits then.
        stop.set()
        _ignore_signals()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        for command, cores in zip(commands, pins):
            child_env = env if cores is None else {**env, "OMP_NUM_THREADS": str(len(cores))}  # a thread per core
            with open(log_dir / f"{child_name(command)}.log", "wb") as log:
                children.append(subprocess.Popen(
                    command, env=child_env, stdout=log, stderr=subprocess.STDOUT,
                    preexec_fn=None if cores is None else lambda cores=cores: os.sched_setaffinity(0, cores)))
        configure(args.security)  # _wait_ready reads discovery
        if args.planner:
            asyncio.run(_unless_stopped(_serve_planned(args, engine_argv, discovery_url, children, log_dir, env), stop))
            return
        infos = asyncio.run(_unless_stopped(
            _wait_ready(discovery_url, args.namespace, worker_count(args), children, log_dir), stop))
        print(f"dynamo-pd ready: OpenAI API at http://{args.host}:{args.port}/v1 "
              f"({' + '.join(' '.join(c[2].split('.')[-1:]) for c in commands[1:])}); Ctrl-C stops", flush=True)
        _report_metrics(args, infos)
        _watch(children, log_dir, stop)
    except KeyboardInterrupt:
        print("dynamo-pd: stopping", flush=True)
    finally:
        _ignore_signals()
        stop_children(children)


async def _serve_planned(args: argparse.Namespace, engine_argv: list[str], discovery_url: str,
                         children: list[subprocess.Popen], log_dir: Path, env: dict[str, str]) -> None:
    """--planner: its local connector starts the workers through worker_command / pool_command and adds
    their processes to `children` (stopped with the rest); serve until the frontend exits."""
    from dynamo_pd.planner.app import serve_local
    from dynamo_pd.planner.connectors.local import Launch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    drain = argparse.ArgumentParser(add_help=False)
    drain.add_argument("--drain-timeout-s", type=float, default=30.0)  # the workers' flag, in engine_argv
    shared = engine_entry(args.engine).shares_process
    launch = Launch(command=lambda role, worker_id: worker_command(args, engine_argv, role, worker_id),
                    pool_command=(lambda role: pool_command(args, engine_argv, role, 0, control=True))
                    if shared else None, env=env, log_dir=log_dir,
                    drain_timeout_s=drain.parse_known_args(engine_argv)[0].drain_timeout_s,
                    ready_timeout_s=_READY_TIMEOUT_S)

    def ready(infos: list) -> None:
        roles = ", ".join(f"{n} {role}" for role, n in initial_counts(args).items())
        print(f"dynamo-pd ready: OpenAI API at http://{args.host}:{args.port}/v1 ({roles}; the planner sizes "
              f"them from here); Ctrl-C stops", flush=True)
        _report_metrics(args, infos)

    await serve_local(args.planner_config, launch, initial_counts(args), discovery_url, args.namespace,
                      args.nats, args.security, children[0], children, ready, metrics_host=args.host)


def _report_metrics(args: argparse.Namespace, infos: list) -> None:
    """Where each process's metrics are; with --prometheus-config, a Prometheus configuration scraping them."""
    import yaml

    from dynamo_pd.worker_metrics import metrics_urls, scrape_config

    urls = metrics_urls(f"http://{args.host}:{args.port}", infos)
    for url, names in urls.items():
        print(f"dynamo-pd metrics: {', '.join(names)} at {url}", flush=True)
    if args.prometheus_config:
        key_file = os.path.abspath(args.api_key_file) if args.api_key_file else None
        with open(args.prometheus_config, "w") as f:
            yaml.safe_dump(scrape_config(urls, key_file), f, sort_keys=False)
        print(f"dynamo-pd: Prometheus configuration in {args.prometheus_config}", flush=True)


def _ignore_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


if __name__ == "__main__":
    main()
