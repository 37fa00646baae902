"""More than one host, for real on one machine: the frontend (with its embedded discovery), a prefill
worker and a decode worker each in its own network namespace, joined by veth pairs on a bridge, on
addresses this test assigns. Nothing can take a loopback shortcut: 127.0.0.1 in one namespace is not
another's. Every plane crosses the bridge: discovery, RPC, the ZMQ event plane (load reports), KV
events, the KV side channel, NIXL. 1P1D over ZMQ and over NIXL must give the text an aggregated
worker gave through the same frontend (native engine, greedy), with KV bytes moved (the frontend
fails a hand-off rather than prefilling locally). Needs root and `ip netns`; skips otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SUBNET = "10.77.0"  # private to the test's own namespaces: no clash with the host's networks
FRONTEND, PREFILL, DECODE = f"{SUBNET}.1", f"{SUBNET}.2", f"{SUBNET}.3"
HTTP_PORT, DISCOVERY_PORT = 8000, 7000
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a land far away,"]
_CLIENT = """
import json, sys, urllib.error, urllib.request
url, body = sys.argv[1], sys.argv[2]
request = urllib.request.Request(url, data=body.encode() or None, headers={"content-type": "application/json"})
try:
    with urllib.request.urlopen(request, timeout=120) as response:
        print(json.dumps([response.status, response.read().decode()]))
except urllib.error.HTTPError as err:
    print(json.dumps([err.code, err.read().decode()]))
except OSError as err:
    print(json.dumps([0, str(err)]))
"""


def sh(*args: str) -> None:
    result = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if result.returncode:
        raise OSError(f"{' '.join(args)}: {result.stderr.strip()}")


class Network:
    """Namespaces `node` (frontend, prefill, decode) on a bridge in a hub namespace; removed on close."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.hub = f"dpd-{tag}-hub"
        self.ns = {role: f"dpd-{tag}-{role}" for role in ("frontend", "prefill", "decode")}
        self.created: list[str] = []

    def create(self) -> None:
        for name in (self.hub, *self.ns.values()):
            sh("ip", "netns", "add", name)
            self.created.append(name)
        sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        for i, (role, address) in enumerate(zip(self.ns, (FRONTEND, PREFILL, DECODE))):
            ns = self.ns[role]
            sh("ip", "-n", self.hub, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            sh("ip", "-n", self.hub, "link", "set", f"v{i}", "master", "br0", "up")
            sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")

    def close(self) -> None:
        for name in reversed(self.created):  # a namespace takes its veth ends with it
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self.created.clear()

    def popen(self, role: str, args: list[str], log: Path) -> subprocess.Popen:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        with open(log, "wb") as out:
            return subprocess.Popen(["ip", "netns", "exec", self.ns[role], sys.executable, *args],
                                    env=env, stdout=out, stderr=subprocess.STDOUT)

    def http(self, path: str, body: dict | None = None) -> tuple[int, str]:
        """A request to the frontend from inside its namespace (the test's own has no route to it)."""
        result = subprocess.run(["ip", "netns", "exec", self.ns["frontend"], sys.executable, "-c", _CLIENT,
                                 f"http://{FRONTEND}:{HTTP_PORT}{path}", json.dumps(body) if body else ""],
                                capture_output=True, text=True, timeout=150)
        if result.returncode:
            raise OSError(f"client in {self.ns['frontend']} failed: {result.stderr[-2000:]}")
        status, text = json.loads(result.stdout)
        return status, text


@pytest.fixture(scope="module")
def network() -> Iterator[Network]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (run the test suite as root)")
    if shutil.which("ip") is None:
        pytest.skip("the `ip` command (iproute2) is missing")
    net = Network()
    try:
        net.create()
    except OSError as exc:
        net.close()
        pytest.skip(f"cannot create network namespaces joined by a bridge here: {exc}")
    try:
        yield net
    finally:
        net.close()


@pytest.fixture(scope="module")
def frontend(network, tmp_path_factory) -> Iterator[Path]:
    logs = tmp_path_factory.mktemp("netns")
    proc = network.popen("frontend", ["-m", "dynamo_pd.frontend", "--host", FRONTEND, "--port", str(HTTP_PORT),
                                      "--discovery", f"tcp://{FRONTEND}:{DISCOVERY_PORT}",
                                      "--on-prefill-failure", "fail"], logs / "frontend.log")
    try:
        wait_for(lambda: network.http("/health")[0] == 200, proc, logs / "frontend.log", 120)
        yield logs
    finally:
        stop([proc])


def wait_for(predicate, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{log.stem} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if predicate():
            return
        time.sleep(1.0)
    raise AssertionError(f"not ready within {timeout_s}s; logs in {log.parent}")


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def metric(network: Network, name: str) -> list[str]:
    status, text = network.http("/metrics")
    return [line for line in text.splitlines() if line.startswith(name)] if status == 200 else []


def serve(network: Network, logs: Path, workers: dict[str, list[str]]) -> list[str]:
    """Start `workers` (role -> extra flags; the namespace named by the role), wait until the frontend
    has their load reports, complete every prompt greedily, stop them; the texts."""
    procs = []
    ids = {role: f"{role}-{uuid.uuid4().hex[:6]}" for role in workers}
    try:
        for role, flags in workers.items():
            kind = "aggregated" if role == "aggregated" else role
            ns_role = "decode" if role == "aggregated" else role
            procs.append(network.popen(ns_role, ["-m", f"dynamo_pd.{kind}", "--engine", "native",
                                                 "--discovery", f"tcp://{FRONTEND}:{DISCOVERY_PORT}",
                                                 "--worker-id", ids[role], "--kv-cache-memory-gb", "0.25", *flags],
                                       logs / f"{ids[role]}.log"))

        def ready() -> bool:  # load reports crossed the event plane from every worker
            lines = metric(network, "dynamo_pd_worker_total_blocks{")
            return all(any(f'"{worker_id}"' in line for line in lines) for worker_id in ids.values())

        for proc, worker_id in zip(procs, ids.values()):
            wait_for(ready, proc, logs / f"{worker_id}.log", 300)
        texts = []
        for prompt in PROMPTS:
            status, body = network.http("/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": prompt,
                                                            "max_tokens": 24, "temperature": 0})
            assert status == 200, f"{status}: {body} (logs in {logs})"
            texts.append(json.loads(body)["choices"][0]["text"])
        return texts
    finally:
        stop(procs)


def moved_bytes(network: Network) -> float:
    lines = metric(network, "dynamo_pd_kv_transfer_bytes_total ")
    return float(lines[0].split()[1]) if lines else 0.0


@pytest.fixture(scope="module")
def aggregated(network, frontend) -> list[str]:
    """The reference: an aggregated worker's texts through the same frontend."""
    texts = serve(network, frontend, {"aggregated": ["--host", DECODE]})
    assert all(texts), texts
    return texts


@pytest.mark.parametrize("transport", ["zmq", pytest.param("nixl", marks=pytest.mark.nixl)])
def test_1p1d_across_namespaces_gives_the_aggregated_text(network, frontend, aggregated, transport):
    if transport == "nixl":
        pytest.importorskip("nixl", reason="NIXL is not installed (pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1)")
    before = moved_bytes(network)
    texts = serve(network, frontend, {
        # the prefill binds its address; the decode binds every interface and advertises its route to discovery
        "prefill": ["--host", PREFILL, "--kv-transport", transport],
        "decode": ["--host", "0.0.0.0", "--kv-transport", transport],
    })
    assert texts == aggregated, f"{transport}: {texts} != {aggregated} (logs in {frontend})"
    assert moved_bytes(network) > before, f"{transport}: no KV bytes crossed (logs in {frontend})"
