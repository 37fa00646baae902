"""An aggregated mistral.rs worker as `python -m dynamo_pd.serve --engine mistralrs` starts it, through the
frontend with the openai client: chat and completions, streamed and not, the same greedy text; its KV events
reach the router."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import MODEL, start_deployment

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
pytest.importorskip("mistralrs", reason="mistralrs is not installed (pip install 'dynamo-pd[mistralrs]')")


def test_mistralrs_serves_chat_and_completions_streamed_and_not(tmp_path, openai_client_factory):
    # mistral.rs reports no load: ready once /ready says a worker serves the model. No health canaries: on a host
    # busy with other tests one missed its 10 s bound and took the only worker out of routing mid-test.
    deployment = start_deployment(tmp_path, "--aggregated", "1", "--engine", "mistralrs",
                                  "--health-check-interval-s", "0", workers_expected=0)
    try:
        deployment.wait_for(lambda: deployment.get("/ready")[0] == 200, 300, "the mistral.rs worker up")
        client = openai_client_factory(deployment)
        messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
        whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        text = whole.choices[0].message.content
        assert "Paris" in text and whole.choices[0].finish_reason == "stop"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3  # token by token
        assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens > 0
        completion = client.completions.create(model=MODEL, prompt="List three colors:", max_tokens=12, temperature=0,
                                               stop=["\n\n"])
        streamed = client.completions.create(model=MODEL, prompt="List three colors:", max_tokens=12, temperature=0,
                                             stop=["\n\n"], stream=True)
        assert "".join(c.choices[0].text for c in streamed) == completion.choices[0].text != ""
        deployment.wait_for(lambda: (deployment.metric("dynamo_pd_router_indexed_blocks", worker="aggregated-0")
                                     or 0) > 0, 20, "its KV events indexed")
    finally:
        codes = deployment.stop()
    assert all(code == 0 for code in codes.values()), codes
