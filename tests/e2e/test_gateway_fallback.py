"""Fallback models end to end: model A (the native SmolLM2) names model B (the same weights under
another name) as its fallback; once every worker of A is stopped, A's requests are answered by B,
and the answer says so (the `model` field, the x-dynamo-pd-model header, dynamo_pd_model_fallbacks)."""

from __future__ import annotations

import json
import signal
import urllib.request

import pytest

from tests.e2e.conftest import MODEL, start_deployment

pytestmark = pytest.mark.slow
OTHER = "smol-b"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    deployment = start_deployment(tmp_path_factory.mktemp("fallback"), "--aggregated", "2",
                                  "--kv-cache-memory-gb", "0.05", "--fallback-model", f"{MODEL}={OTHER}",
                                  worker_args={"aggregated-1": ["--served-model-name", OTHER]})
    yield deployment
    deployment.stop()


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


def test_a_model_without_workers_is_answered_by_its_fallback_marked_so(deployment):
    deployment.wait_for(lambda: len(json.loads(deployment.get("/v1/models")[1]).get("data", [])) == 2, 60,
                        "both models listed")
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
    assert deployment.metric("dynamo_pd_model_fallbacks_total", answered_by=OTHER, model=MODEL) >= 2  # labels sorted

    status, body, header = complete(deployment, OTHER)  # B itself: no fallback counted
    assert (status, body["model"], header) == (200, OTHER, OTHER)
