"""Start a deployment for a comparison, wait until the frontend routes to every worker, stop it.

The frontend and the workers are started here, process by process, rather than through
`python -m dynamo_pd.serve`, which does not pin each worker to its own cores. Mocker workers of one role share one process (they compute nothing); every other engine's worker
is its own process pinned to its share of this process's cores, so N aggregated workers and xPyD
with x + y = N get the same compute.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from dynamo_pd.runtime.ports import free_port
from dynamo_pd.serve import stop_children

_READY_TIMEOUT_S = 300.0
_STOP_GRACE_S = 15.0
_WORKER_LABEL = re.compile(r'^dynamo_pd_router_indexed_blocks\{worker="([^"]+)"\}', re.M)


@dataclass(frozen=True)
class Deployment:
    name: str
    engine: str  # "mocker", or any engine a worker takes (--engine)
    aggregated: int = 0
    prefill: int = 0
    decode: int = 0
    router_policy: str = "kv"
    worker_args: tuple[str, ...] = ()  # engine flags for every worker

    @property
    def roles(self) -> list[tuple[str, int]]:
        roles = [("aggregated", self.aggregated), ("prefill", self.prefill), ("decode", self.decode)]
        return [(role, n) for role, n in roles if n]

    @property
    def workers(self) -> int:
        return sum(n for _, n in self.roles)


def core_sets(workers: int, cores: list[int]) -> list[list[int]]:
    """Each worker its own equal share of the cores (workers beyond the cores share them in turn)."""
    share = max(1, len(cores) // workers)
    return [[cores[(i * share + j) % len(cores)] for j in range(share)] for i in range(workers)]


def commands(d: Deployment, port: int, discovery_port: int) -> list[tuple[str, list[str], list[int] | None]]:
    """(name, argv, cores to pin or None) of every process: the frontend first."""
    discovery = f"tcp://127.0.0.1:{discovery_port}"
    procs = [("frontend", [sys.executable, "-m", "dynamo_pd.frontend", "--port", str(port), "--discovery", discovery,
                           "--router-policy", d.router_policy], None)]
    if d.engine == "mocker":
        for role, n in d.roles:
            procs.append((role, [sys.executable, "-m", "dynamo_pd.mocker", "--workers", str(n), "--role", role,
                                 "--discovery", discovery, "--worker-id", role, *d.worker_args], None))
        return procs
    cores = core_sets(d.workers, sorted(os.sched_getaffinity(0)))
    names = [f"{role}-{i}" for role, n in d.roles for i in range(n)]
    for name, pinned in zip(names, cores):
        role = name.rsplit("-", 1)[0]
        procs.append((name, [sys.executable, "-m", f"dynamo_pd.{role}", "--engine", d.engine, "--discovery", discovery,
                             "--worker-id", name, *d.worker_args], pinned))
    return procs


def _routed_workers(client: httpx.Client) -> int:
    try:
        return len(set(_WORKER_LABEL.findall(client.get("/metrics").text)))
    except httpx.HTTPError:  # the frontend is still starting
        return 0


@contextlib.contextmanager
def running(d: Deployment, log_dir: Path) -> Iterator[str]:
    """The deployment's base URL while it runs; every process is stopped on exit."""
    log_dir.mkdir(parents=True, exist_ok=True)
    port, discovery_port = free_port(), free_port()
    children: list[tuple[str, subprocess.Popen]] = []
    try:
        for name, argv, pinned in commands(d, port, discovery_port):
            env = dict(os.environ)
            if pinned is not None:  # one thread per pinned core: no oversubscription
                env["OMP_NUM_THREADS"] = str(len(pinned))
            with (log_dir / f"{name}.log").open("wb") as log:
                children.append((name, subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                    preexec_fn=None if pinned is None else lambda cores=pinned: os.sched_setaffinity(0, cores))))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + _READY_TIMEOUT_S
        with httpx.Client(base_url=url, timeout=5) as client:
            while _routed_workers(client) < d.workers:
                for name, child in children:
                    if child.poll() is not None:
                        raise SystemExit(f"error: {d.name}: {name} exited with code {child.returncode} "
                                         f"(log: {log_dir / name}.log)")
                if time.monotonic() > deadline:
                    raise SystemExit(f"error: {d.name}: workers not routed within {_READY_TIMEOUT_S:.0f}s "
                                     f"(logs in {log_dir})")
                time.sleep(0.5)  # polling a child process's state: there is nothing to wait on
        yield url
    finally:
        stop_children([child for _, child in children], _STOP_GRACE_S)

