"""`python -m dynamo_pd.serve` with a cluster secret (from the environment) and an API key (from a file):
1P1D gives the aggregated text, a peer without the secret is refused, and no child's argv holds the key."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dynamo_pd.protocol import WorkerInfo
from dynamo_pd.runtime import RequestContext, RpcClient, WorkerGoneError, connect_discovery
from dynamo_pd.runtime.ports import free_port
from dynamo_pd.runtime.security import SECRET_ENV, Security
from tests.e2e.conftest import MODEL, start_deployment

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SECRET = "e2e-cluster-secret-0123456789abcdef"
API_KEY = "sk-e2e-key-that-must-not-show-in-ps"
PROMPTS = ["The capital of France is", "List three colors:"]


def children_argv(pid: int) -> list[str]:
    """The command lines of `pid`'s children, as `ps` shows them to every user."""
    lines = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            if f"\nPPid:\t{pid}\n" in status.read_text():
                lines.append((status.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue  # gone meanwhile
    return lines


def complete(client) -> list[str]:
    return [client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0).choices[0].text
            for p in PROMPTS]


async def refused_without_the_secret(discovery_url: str) -> None:
    async with await connect_discovery(discovery_url, security=Security(SECRET)) as discovery:
        workers = await discovery.list(WorkerInfo)
    assert workers, "no worker registered"
    client = RpcClient(connect_timeout_s=3.0, security=Security())
    try:
        with pytest.raises(WorkerGoneError):
            async for _ in client.stream(workers[0].rpc_endpoint, b"", RequestContext("intruder")):
                pass
    finally:
        await client.close()


def test_a_1p1d_serve_with_a_cluster_secret(tmp_path, openai_client_factory):
    import openai

    (tmp_path / "aggregated").mkdir()
    reference = start_deployment(tmp_path / "aggregated", "--aggregated", "1", "--kv-cache-memory-gb", "0.25")
    try:
        aggregated = complete(openai_client_factory(reference))
    finally:
        reference.stop()

    (tmp_path / "api-key").write_text(API_KEY + "\n")
    port, discovery_port = free_port(), free_port()
    env = dict(os.environ, **{SECRET_ENV: SECRET}, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    serve = subprocess.Popen([sys.executable, "-m", "dynamo_pd.serve", "--port", str(port), "--discovery-port",
                              str(discovery_port), "--api-key-file", str(tmp_path / "api-key"),
                              "--kv-cache-memory-gb", "0.25"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, output = time.monotonic() + 300, []
        while not any(line.startswith("dynamo-pd ready") for line in output):
            line = serve.stdout.readline()
            assert line and time.monotonic() < deadline, "serve not ready:\n" + "".join(output)
            output.append(line)
        assert not any(API_KEY in argv for argv in children_argv(serve.pid))
        assert not any(SECRET in argv for argv in children_argv(serve.pid))

        url = f"http://127.0.0.1:{port}/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=url, api_key=API_KEY, max_retries=0, timeout=120)
        assert complete(client) == aggregated
        asyncio.run(refused_without_the_secret(f"tcp://127.0.0.1:{discovery_port}"))
    finally:
        serve.send_signal(signal.SIGINT)
        try:
            serve.wait(60)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()
