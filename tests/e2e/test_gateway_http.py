"""An OpenAI-compatible server as a pool member: llama-cpp-python's own server (`python -m
llama_cpp.server`, the SmolLM2 GGUF) behind two `--engine http` workers of one model, next to a
native SmolLM2 worker of another, on one frontend. Answers equal the server's own; the router
predicts the server's cache from its placements (a repeated prompt goes to the same member),
marked approximate in metrics; a prefill role is refused in one line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dynamo_pd.runtime.ports import free_port
from tests.e2e.conftest import MODEL, Deployment, llama_server_command, with_openai_members

pytestmark = pytest.mark.slow
pytest.importorskip("llama_cpp.server", reason="llama-cpp-python[server] is not installed")
HTTP_MODEL = "smol-llamacpp"
PROMPT = "The history of the city begins with a small village on the river, where farmers and fishermen lived"


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    port = free_port()
    logs = tmp_path_factory.mktemp("llama_server")
    server = Deployment(url=f"http://127.0.0.1:{port}", logs=logs)
    server.spawn("llama_server", llama_server_command(port, 2048, "--model_alias", "smollm2-gguf"))
    server.wait_for(lambda: server.get("/v1/models")[0] == 200, 120, "llama.cpp server up")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, llama_server):
    with with_openai_members(tmp_path_factory.mktemp("mixed"), llama_server.url, HTTP_MODEL, 2) as deployment:
        yield deployment


def test_an_openai_server_serves_as_pool_members_with_a_predicted_cache(mixed, llama_server, openai_client_factory):
    approx = {w: lambda w=w: mixed.metric("dynamo_pd_router_approx_blocks", model=HTTP_MODEL, worker=w) or 0
              for w in ("http-0", "http-1")}
    status, body = mixed.post("/v1/completions", {"model": HTTP_MODEL, "prompt": PROMPT, "max_tokens": 12,
                                                  "temperature": 0})
    assert status == 200 and body["model"] == HTTP_MODEL, body
    assert body["choices"][0]["text"] == llama_server.complete(PROMPT, 12)  # the server's own answer
    assert body["usage"]["completion_tokens"] > 0
    chosen = [w for w, blocks in approx.items() if blocks() > 0]
    assert len(chosen) == 1, {w: blocks() for w, blocks in approx.items()}  # the prompt's blocks, predicted there
    before = approx[chosen[0]]()
    for _ in range(3):  # the same prefix again: the member predicted to hold it
        status, body = mixed.post("/v1/completions", {"model": HTTP_MODEL, "prompt": PROMPT + " and", "max_tokens": 2})
        assert status == 200, body
    other = ({"http-0", "http-1"} - set(chosen)).pop()
    assert approx[other]() == 0 and approx[chosen[0]]() >= before

    client = openai_client_factory(mixed)
    chunks = list(client.chat.completions.create(model=HTTP_MODEL, stream=True, max_tokens=8, temperature=0,
                                                 messages=[{"role": "user", "content": "Say hi"}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) and chunks[0].model == HTTP_MODEL
    native = mixed.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})[1]
    assert native["model"] == MODEL and mixed.metric("dynamo_pd_router_approx_blocks", model=MODEL,
                                                     worker="native-0") is None  # it has KV events

    status, body = mixed.post("/v1/completions", {"model": HTTP_MODEL, "prompt": "hi", "max_tokens": 2, "logprobs": 1})
    assert status == 400 and body["error"]["param"] == "logprobs"


def test_an_http_member_runs_aggregated_only(llama_server):
    done = subprocess.run([sys.executable, "-m", "dynamo_pd.prefill", "--engine", "http", "--url",
                           llama_server.url + "/v1", "--discovery", f"tcp://127.0.0.1:{free_port()}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: --engine http runs aggregated workers only")
