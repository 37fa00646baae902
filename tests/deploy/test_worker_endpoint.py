"""A worker's /health, /ready and /metrics through its life, as a Kubernetes probe sees them: /health answers
while the worker waits for discovery, /ready is 503 until it registered (its engine running is not enough),
200 then, and 503 again from the moment SIGTERM starts its drain, with a request still streaming."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from dynamo_pd.runtime.ports import free_port
from tests.deploy.scrape import get, scrape, value
from tests.waits import wait

pytestmark = pytest.mark.slow


def spawn(logs: Path, name: str, *args: str) -> subprocess.Popen:
    with open(logs / f"{name}.log", "wb") as log:
        return subprocess.Popen([sys.executable, "-m", *args], stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def port_below_the_ephemeral_range() -> int:
    """A free port that no outgoing connection can take (Linux's ephemeral range starts at 32768): the worker
    connects to discovery for seconds before it listens, and one of its attempts (or another test's
    connection) once took a port picked by free_port(), so the frontend could not bind it (a full run, 2026-11-29)."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


def test_ready_follows_the_registration_and_the_drain(tmp_path):
    discovery = f"tcp://127.0.0.1:{port_below_the_ephemeral_range()}"
    metrics_port, http_port = free_port(), free_port()
    endpoint = f"http://127.0.0.1:{metrics_port}"
    worker = spawn(tmp_path, "worker", "dynamo_pd.aggregated", "--engine", "mocker", "--worker-id", "agg-0",
                   "--discovery", discovery, "--metrics-port", str(metrics_port), "--drain-timeout-s", "120")
    frontend = None
    try:
        wait(lambda: get(f"{endpoint}/health")[0] == 200, "the worker's /health", 300)
        wait(lambda: value(scrape(f"{endpoint}/metrics"), "dynamo_pd_worker_kv_blocks_total", worker="agg-0"),
             "the engine started (its KV blocks rendered)", 300)
        # No discovery listens yet: the engine runs, but the worker cannot have registered.
        status, body = get(f"{endpoint}/ready")
        assert (status, json.loads(body)) == (503, {"status": "not ready", "workers": {"agg-0": "not ready"}})
        assert value(scrape(f"{endpoint}/metrics"), "dynamo_pd_worker_ready", worker="agg-0") == 0
        assert get(f"{endpoint}/ready", method="HEAD") == (503, b"")
        assert get(f"{endpoint}/nothing-here")[0] == 404
        assert get(f"{endpoint}/metrics", method="POST")[0] == 405

        frontend = spawn(tmp_path, "frontend", "dynamo_pd.frontend", "--port", str(http_port), "--discovery",
                         discovery)
        wait(lambda: get(f"{endpoint}/ready")[0] == 200, "the worker's /ready after it registered", 300)
        assert json.loads(get(f"{endpoint}/ready")[1]) == {"status": "ready", "workers": {"agg-0": "ready"}}
        assert value(scrape(f"{endpoint}/metrics"), "dynamo_pd_worker_ready", worker="agg-0") == 1
        wait(lambda: get(f"http://127.0.0.1:{http_port}/ready")[0] == 200, "the frontend's /ready", 120)

        body = {"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "max_tokens": 6000, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{http_port}/v1/completions", json=body, timeout=60) as reply:
            assert reply.status_code == 200
            # held until the block ends: a dropped line iterator closes the connection when it is collected
            lines = reply.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # it is generating
            worker.send_signal(signal.SIGTERM)
            wait(lambda: get(f"{endpoint}/ready")[0] == 503, "/ready 503 once the drain started", 30)
            assert worker.poll() is None, "the worker exited instead of draining the request in flight"
            assert value(scrape(f"{endpoint}/metrics"), "dynamo_pd_worker_ready", worker="agg-0") == 0
        # The client left: its request ends, the drain with it, and the worker exits cleanly.
        assert worker.wait(90) == 0
    finally:
        stop(worker)
        if frontend is not None:
            stop(frontend)
