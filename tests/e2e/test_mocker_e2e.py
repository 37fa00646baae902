"""Mocker deployments end to end, driven by the openai client: a mocker prefill and decode worker
handing KV over through kv_transfer, and 16 aggregated mocker workers in one process."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from dynamo_pd.engines.base import EngineConfig
from dynamo_pd.engines.mocker.core import MockerCore
from dynamo_pd.engines.mocker.profile import h100_llama8b
from dynamo_pd.protocol import EngineRequest, SamplingParams, StopConditions
from dynamo_pd.serve import parse_args, plan
from tests.e2e.conftest import MODEL, start_deployment

pytestmark = pytest.mark.slow
PROMPTS = [[1000 + 7 * i + j for j in range(40 + 9 * i)] for i in range(8)]  # token ids; 40 to 103 tokens


def mocker_text(ids: list[int], max_tokens: int) -> str:
    """What a mocker answers to a greedy request (the prompt alone decides)."""
    core = MockerCore(EngineConfig(num_kv_blocks=16), h100_llama8b())
    core.add_request(EngineRequest(request_id="x", prompt_token_ids=ids,
                                   sampling=SamplingParams(temperature=0),
                                   stop=StopConditions(max_tokens=max_tokens)))
    text = ""
    while core.has_work:
        text += "".join(out.text for out in core.step())
    return text


def complete(client, ids: list[int], **kwargs):
    return client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0, **kwargs)


def test_a_mocker_prefill_and_decode_hand_off_through_kv_transfer(tmp_path, openai_client_factory):
    deployment = start_deployment(tmp_path, "--prefill", "1", "--decode", "1", "--engine", "mocker",
                                  "--speedup", "10")
    try:
        client = openai_client_factory(deployment)
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi there!"}], max_tokens=16, stream=True,
            stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].usage.completion_tokens == 16 and chunks[-1].usage.prompt_tokens > 5
        for ids in PROMPTS[:2]:
            response = complete(client, ids, logprobs=2)
            assert response.choices[0].text == mocker_text(ids, 12)
            assert len(response.choices[0].logprobs.tokens) == 12
        assert deployment.metric("dynamo_pd_kv_transfer_bytes_total") > 0
        assert deployment.rendered_metric("dynamo_pd_prefill_fallbacks_total", reason="prefill_failed") == 0
        assert deployment.rendered_metric("dynamo_pd_prefill_fallbacks_total", reason="transfer_failed") == 0
    finally:
        codes = deployment.stop()
    assert all(code == 0 for code in codes.values()), codes


def test_sixteen_mocker_workers_in_one_process_serve_requests(tmp_path, openai_client_factory):
    """`serve --aggregated 16 --engine mocker` runs the 16 workers in one process."""
    options, engine_argv = parse_args(["--aggregated", "16", "--engine", "mocker", "--speedup", "10"])
    assert [c[2] for c in plan(options, engine_argv)[1]] == ["dynamo_pd.frontend", "dynamo_pd.mocker"]
    deployment = start_deployment(tmp_path, "--aggregated", "16", "--engine", "mocker", "--speedup", "10")
    try:
        assert set(deployment.procs) == {"frontend", "aggregated"}
        assert deployment.metric("dynamo_pd_worker_total_blocks", worker="aggregated-15") is not None
        client = openai_client_factory(deployment)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            texts = list(pool.map(lambda ids: complete(client, ids).choices[0].text, PROMPTS))
        assert texts == [mocker_text(ids, 12) for ids in PROMPTS]
    finally:
        codes = deployment.stop()
    assert all(code == 0 for code in codes.values()), codes
