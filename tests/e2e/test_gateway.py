"""The gateway end to end: one frontend serving two models from one discovery and event plane (the
native SmolLM2 under its own name, and the same weights registered as another model through
--served-model-name); each request reaches only its model's workers."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import MODEL, start_deployment

pytestmark = pytest.mark.slow
OTHER = "smol-b"
PROMPT = "The history of the city begins with a small village on the river, where farmers and fishermen"


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    deployment = start_deployment(tmp_path_factory.mktemp("gateway"), "--aggregated", "2",
                                  "--kv-cache-memory-gb", "0.05",
                                  worker_args={"aggregated-1": ["--served-model-name", OTHER]})
    yield deployment
    codes = deployment.stop()
    assert all(code == 0 for code in codes.values()), codes


def blocks(deployment, worker: str) -> float:
    return deployment.metric("dynamo_pd_router_indexed_blocks", worker=worker) or 0.0


def test_two_models_on_one_frontend_each_request_reaches_only_its_model(two_models):
    import json

    two_models.wait_for(lambda: len(json.loads(two_models.get("/v1/models")[1]).get("data", [])) == 2, 60,
                        "both models listed")
    assert {m["id"] for m in json.loads(two_models.get("/v1/models")[1])["data"]} == {MODEL, OTHER}
    assert (blocks(two_models, "aggregated-0"), blocks(two_models, "aggregated-1")) == (0, 0)

    texts = {}
    for model, worker, other in ((MODEL, "aggregated-0", "aggregated-1"), (OTHER, "aggregated-1", "aggregated-0")):
        before = blocks(two_models, other)
        status, body = two_models.post("/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 8,
                                                           "temperature": 0})
        assert status == 200 and body["model"] == model, body
        texts[model] = body["choices"][0]["text"]
        two_models.wait_for(lambda: blocks(two_models, worker) > 0, 20, f"{worker}'s KV events indexed")
        assert blocks(two_models, other) == before  # the other model's worker saw nothing
    assert texts[MODEL] == texts[OTHER]  # the same weights behind both names

    status, body = two_models.post("/v1/completions", {"model": "gpt-nothing", "prompt": "hi", "max_tokens": 2})
    assert status == 404 and body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
    assert all(repr(name) in body["error"]["message"] for name in (MODEL, OTHER))
