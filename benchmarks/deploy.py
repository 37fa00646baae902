"""Start a deployment for a comparison with `python -m dynamo_pd.serve`, wait until the frontend routes
to every worker, stop it.

`serve --pin-cores` pins every worker of a real engine to its own equal share of this process's cores,
so N aggregated workers and xPyD with x + y = N get the same compute; mocker workers of one role share
one process (they compute nothing).
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from dynamo_pd.runtime.ports import free_port

_READY_TIMEOUT_S = 300.0
_STOP_GRACE_S = 15.0
_WORKER_LABEL = re.compile(r'^dynamo_pd_router_indexed_blocks\{worker="([^"]+)"\}', re.M)
_METRICS_LINE = re.compile(r"^dynamo-pd metrics: (.+) at (\S+)$", re.M)  # serve's, one per process


@dataclass(frozen=True)
class Deployment:
    name: str
    engine: str  # "mocker", or any engine a worker takes (--engine)
    aggregated: int = 0
    prefill: int = 0
    decode: int = 0
    router_policy: str | None = None  # None: serve's default policy
    worker_args: tuple[str, ...] = ()  # engine flags for every worker

    @property
    def roles(self) -> list[tuple[str, int]]:
        roles = [("aggregated", self.aggregated), ("prefill", self.prefill), ("decode", self.decode)]
        return [(role, n) for role, n in roles if n]

    @property
    def workers(self) -> int:
        return sum(n for _, n in self.roles)


def command(d: Deployment, port: int, discovery_port: int) -> list[str]:
    """The deployment's `python -m dynamo_pd.serve` command line."""
    counts = ["--aggregated", str(d.aggregated)] if d.aggregated else ["--prefill", str(d.prefill),
                                                                        "--decode", str(d.decode)]
    return [sys.executable, "-m", "dynamo_pd.serve", *counts, "--engine", d.engine, "--port", str(port),
            "--discovery-port", str(discovery_port), *(("--router-policy", d.router_policy) if d.router_policy else ()),
            "--pin-cores", *d.worker_args]


def _routed_workers(client: httpx.Client) -> int:
    try:
        return len(set(_WORKER_LABEL.findall(client.get("/metrics").text)))
    except httpx.HTTPError:  # the frontend is still starting
        return 0


def stop_on_sigterm() -> None:
    """SIGTERM (a CI timeout, a `kill`) ends a benchmark as Ctrl-C does, through the `finally` blocks that stop
    the processes it started; by default it would end Python at once and leave them serving. Main thread only."""

    def interrupt(_signum, _frame) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


@contextlib.contextmanager
def running(d: Deployment, log_dir: Path) -> Iterator[str]:
    """The deployment's base URL while it runs; serve stops every process on exit."""
    log_dir.mkdir(parents=True, exist_ok=True)
    port, discovery_port = free_port(), free_port()
    log_path = log_dir / "serve.log"  # serve's own lines; it names the folder of every child's log
    with log_path.open("wb") as log:
        serve = subprocess.Popen(command(d, port, discovery_port), stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + _READY_TIMEOUT_S
        with httpx.Client(base_url=url, timeout=5) as client:
            while _routed_workers(client) < d.workers:
                if serve.poll() is not None:
                    last = (log_path.read_text(errors="replace").strip().splitlines() or ["(no output)"])[-1]
                    raise SystemExit(f"error: {d.name}: serve exited with code {serve.returncode}: {last} "
                                     f"(log: {log_path})")
                if time.monotonic() > deadline:
                    raise SystemExit(f"error: {d.name}: workers not routed within {_READY_TIMEOUT_S:.0f}s "
                                     f"(log: {log_path})")
                time.sleep(0.5)  # polling a child process's state: there is nothing to wait on
        yield url
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGINT)  # serve stops its children, workers first
        try:
            serve.wait(_STOP_GRACE_S + 15)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()


def metrics_urls(serve_log: Path, done: Callable[[dict[str, list[str]]], bool],
                 timeout_s: float = 60.0) -> dict[str, list[str]]:
    """Each process's /metrics URL -> what serves there, from serve's lines naming them (the frontend's and the
    workers' once every worker is ready, the planner's once it starts), as soon as `done` finds what it needs."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = {url: names.split(", ") for names, url in _METRICS_LINE.findall(serve_log.read_text())}
        if done(found):
            return found
        if time.monotonic() > deadline:
            raise SystemExit(f"error: serve did not name the /metrics URLs wanted within {timeout_s:g} s "
                             f"(log: {serve_log})")
        time.sleep(0.5)  # a child's log: nothing to wait on but the file


def worker_metrics_urls(serve_log: Path, workers: int) -> list[str]:
    """The /metrics URLs of the deployment's `workers` workers (one per process: a mocker process has many)."""
    def named(urls: dict[str, list[str]]) -> list[str]:
        return [url for url, names in urls.items() if names not in (["frontend"], ["planner"])]

    return named(metrics_urls(serve_log, lambda urls: sum(len(urls[u]) for u in named(urls)) >= workers))
