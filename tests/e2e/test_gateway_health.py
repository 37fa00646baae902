"""Health checks end to end: two `--engine http` workers of one model, each in front of its own
llama-cpp-python server, a canary each every second. When one server hangs (SIGSTOP) its worker
still holds its discovery lease but its canary fails: it leaves routing within two health periods
(requests meanwhile all go to the other member: none waits on the hung one and is retried), and
after SIGCONT it passes again and is back in routing. /health reports the model's readiness and
its unhealthy workers."""

from __future__ import annotations

import json
import signal
import sys
import uuid

import pytest

from dynamo_pd.runtime.ports import free_port
from tests.e2e.conftest import Deployment, llama_server_command

pytestmark = pytest.mark.slow
pytest.importorskip("llama_cpp.server", reason="llama-cpp-python[server] is not installed")
MODEL = "smol-llamacpp"
INTERVAL_S, TIMEOUT_S = 1.0, 3.0


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    made = []
    for i in range(2):
        port = free_port()
        server = Deployment(url=f"http://127.0.0.1:{port}", logs=tmp_path_factory.mktemp(f"llama_server{i}"))
        server.spawn("llama_server", llama_server_command(port, 512))
        made.append(server)
    for server in made:
        server.wait_for(lambda: server.get("/v1/models")[0] == 200, 120, "llama.cpp server up")
    yield made
    for server in made:
        server.procs["llama_server"].send_signal(signal.SIGCONT)  # never leave a stopped process behind
        server.stop()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, servers):
    port, discovery = free_port(), f"tcp://127.0.0.1:{free_port()}"
    deployment = Deployment(url=f"http://127.0.0.1:{port}", logs=tmp_path_factory.mktemp("health"))
    common = ["--discovery", discovery, "--namespace", f"test-{uuid.uuid4().hex[:8]}"]
    deployment.spawn("frontend", [sys.executable, "-m", "dynamo_pd.frontend", "--port", str(port), *common,
                                    "--health-check-interval-s", str(INTERVAL_S),
                                    "--health-check-timeout-s", str(TIMEOUT_S)])
    for i, server in enumerate(servers):
        deployment.spawn(f"http-{i}", [sys.executable, "-m", "dynamo_pd.aggregated", "--engine", "http",
                                         "--url", server.url + "/v1", "--served-model-name", MODEL,
                                         "--worker-id", f"http-{i}", *common])
    yield deployment
    deployment.stop()


def health(deployment) -> dict:
    return json.loads(deployment.get("/health")[1])["models"].get(MODEL, {})


def healthy(deployment, worker: str) -> float | None:
    return deployment.metric("dynamo_pd_worker_healthy", model=MODEL, worker=worker)


def test_a_hung_worker_fails_its_canary_leaves_routing_and_comes_back(deployment, servers):
    both = {"ready": True, "workers": ["http-0", "http-1"], "unhealthy": []}
    deployment.wait_for(lambda: health(deployment) == both and healthy(deployment, "http-0") ==
                        healthy(deployment, "http-1") == 1, 120, "both workers pass their canaries")

    hung = servers[1].procs["llama_server"]
    hung.send_signal(signal.SIGSTOP)
    try:
        # within two periods of a canary's timeout, plus a scheduling margin on a loaded machine
        deployment.wait_for(lambda: health(deployment)["unhealthy"] == ["http-1"], 2 * (INTERVAL_S + TIMEOUT_S) + 5,
                            "the hung worker out of routing")
        assert health(deployment)["workers"] == ["http-0", "http-1"]  # still registered: only routing left it
        assert healthy(deployment, "http-1") == 0 and healthy(deployment, "http-0") == 1
        assert deployment.metric("dynamo_pd_health_check_failures_total", model=MODEL, worker="http-1") >= 1
        for i in range(6):  # a request placed on the hung member would wait on it, then be retried
            status, body = deployment.post("/v1/completions", {"model": MODEL, "prompt": f"Count to {i}:",
                                                               "max_tokens": 4, "temperature": 0})
            assert status == 200, body
        assert not any(line.startswith("dynamo_pd_retries_total{")
                       for line in deployment.get("/metrics")[1].decode().splitlines())
    finally:
        hung.send_signal(signal.SIGCONT)
    deployment.wait_for(lambda: health(deployment) == both and healthy(deployment, "http-1") == 1, 30,
                        "the worker back in routing")
