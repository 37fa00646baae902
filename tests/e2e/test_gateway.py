"""The gateway end to end: one frontend serving two models from one discovery and event plane (the
native SmolLM2 under its own name, model A, and the same weights registered as another model through
--served-model-name, model B); each request reaches only its model's workers. A names B as its fallback
model: once every worker of A is stopped, A's requests are answered by B, and the answer says so (the
`model` field, the x-dynamo-pd-model header, dynamo_pd_model_fallbacks). One deployment for both: the
fallback changes nothing while A has workers, and stopping A's worker ends the story."""

from __future__ import annotations

import json
import signal
import urllib.request

import pytest

from tests.e2e.conftest import MODEL, start_deployment

pytestmark = pytest.mark.slow
OTHER = "smol-b"
PROMPT = "The history of the city begins with a small village on the river, where farmers and fishermen"


def blocks(deployment, worker: str) -> float:
    return deployment.metric("dynamo_pd_router_indexed_blocks", worker=worker) or 0.0


def complete(deployment, model: str, stream: bool = False) -> tuple[int, dict, str]:
    """Status, body (the last data chunk when streamed) and the x-dynamo-pd-model header."""
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "stream": stream}
    request = urllib.request.Request(deployment.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            text = response.read().decode()
            header = response.headers.get("x-dynamo-pd-model")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), err.headers.get("x-dynamo-pd-model")
    if stream:
        chunks = [line[6:] for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
        return 200, json.loads(chunks[0]), header
    return 200, json.loads(text), header


def test_each_request_reaches_only_its_model_and_a_model_without_workers_is_answered_by_its_fallback(
        tmp_path):
    deployment = start_deployment(tmp_path, "--aggregated", "2", "--kv-cache-memory-gb", "0.05",
                                  "--fallback-model", f"{MODEL}={OTHER}",
                                  worker_args={"aggregated-1": ["--served-model-name", OTHER]})
    try:
        deployment.wait_for(lambda: len(json.loads(deployment.get("/v1/models")[1]).get("data", [])) == 2, 60,
                            "both models listed")
        assert {m["id"] for m in json.loads(deployment.get("/v1/models")[1])["data"]} == {MODEL, OTHER}
        assert (blocks(deployment, "aggregated-0"), blocks(deployment, "aggregated-1")) == (0, 0)

        texts = {}
        for model, worker, other in ((MODEL, "aggregated-0", "aggregated-1"), (OTHER, "aggregated-1", "aggregated-0")):
            before = blocks(deployment, other)
            status, body = deployment.post("/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 8,
                                                               "temperature": 0})
            assert status == 200 and body["model"] == model, body
            texts[model] = body["choices"][0]["text"]
            deployment.wait_for(lambda: blocks(deployment, worker) > 0, 20, f"{worker}'s KV events indexed")
            assert blocks(deployment, other) == before  # the other model's worker saw nothing
        assert texts[MODEL] == texts[OTHER]  # the same weights behind both names

        status, body = deployment.post("/v1/completions", {"model": "gpt-nothing", "prompt": "hi", "max_tokens": 2})
        assert status == 404 and body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
        assert all(repr(name) in body["error"]["message"] for name in (MODEL, OTHER))

        status, body, header = complete(deployment, MODEL)
        assert (status, body["model"], header) == (200, MODEL, MODEL)  # A answers while it can
        text = body["choices"][0]["text"]
        assert not deployment.metric("dynamo_pd_model_fallbacks_total", answered_by=OTHER, model=MODEL)

        deployment.procs["aggregated-0"].send_signal(signal.SIGTERM)  # A's only worker
        assert deployment.procs["aggregated-0"].wait(30) == 0
        deployment.wait_for(lambda: complete(deployment, MODEL)[2] == OTHER, 30, "A answered by its fallback")
        status, body, header = complete(deployment, MODEL)
        assert (status, body["model"], header) == (200, OTHER, OTHER)
        assert body["choices"][0]["text"] == text  # the same weights behind both names
        status, chunk, header = complete(deployment, MODEL, stream=True)
        assert (status, chunk["model"], header) == (200, OTHER, OTHER)
        assert deployment.metric("dynamo_pd_model_fallbacks_total", answered_by=OTHER, model=MODEL) >= 2

        status, body, header = complete(deployment, OTHER)  # B itself: no fallback counted
        assert (status, body["model"], header) == (200, OTHER, OTHER)
    finally:
        codes = deployment.stop()
    assert all(code == 0 for code in codes.values()), codes
