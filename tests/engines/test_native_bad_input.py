"""Bad input gets a clear error naming the bad value, never a hang or a crashed engine."""

from __future__ import annotations

import asyncio

import pytest

from dynamo_pd.engines.base import EngineConfig
from dynamo_pd.engines.native.core import EngineCore
from dynamo_pd.engines.native.engine import NativeEngine
from dynamo_pd.llm import LLM
from dynamo_pd.model_store import ModelNotFoundError
from dynamo_pd.protocol import (
    EngineRequest,
    InvalidRequestError,
    PromptTooLongError,
    SamplingParams,
    StopConditions,
)
from dynamo_pd.runtime import RequestContext

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def core():
    # 8 blocks of 16: a 128-token KV cache, smaller than the 256-token context.
    return EngineCore(EngineConfig(num_kv_blocks=8, max_model_len=256))


def req(ids=(1, 2, 3), rid="r", **kw) -> EngineRequest:
    stop = StopConditions(max_tokens=kw.pop("max_tokens", 4), stop=kw.pop("stop", []))
    return EngineRequest(request_id=rid, prompt_token_ids=list(ids), sampling=SamplingParams(**kw), stop=stop)


@pytest.mark.parametrize("bad, param, message", [
    (dict(ids=[]), "prompt", "prompt is empty"),
    (dict(ids=[1, 49152]), "prompt", "token id 49152 is outside the vocabulary"),
    (dict(ids=[-1]), "prompt", "token id -1"),
    (dict(temperature=-0.5), "temperature", "temperature must be >= 0, got -0.5"),
    (dict(temperature=float("nan")), "temperature", "temperature"),
    (dict(top_p=0.0), "top_p", "top_p must be in"),
    (dict(top_k=-3), "top_k", "top_k must be"),
    (dict(repetition_penalty=0.0), "repetition_penalty", "repetition_penalty must be > 0"),
    (dict(frequency_penalty=3.0), "frequency_penalty", "frequency_penalty"),
    (dict(logprobs=50), "logprobs", "logprobs must be in"),
    (dict(max_tokens=0), "max_tokens", "max_tokens must be >= 1, got 0"),
    (dict(stop=[""]), "stop", "stop strings must be non-empty"),
])
def test_invalid_requests_are_rejected(core, bad, param, message):
    with pytest.raises(InvalidRequestError, match=message) as err:
        core.add_request(req(**bad))
    assert err.value.param == param
    assert not core.seqs and not core.has_work


def test_too_long_for_context_or_cache(core):
    with pytest.raises(PromptTooLongError, match=r"prompt \(300 tokens\) plus max_tokens \(4\) is 304 tokens"):
        core.add_request(req(ids=[5] * 300))
    with pytest.raises(PromptTooLongError, match="context of 256 tokens"):
        core.add_request(req(ids=[5] * 200, max_tokens=100))
    with pytest.raises(PromptTooLongError, match=r"whole KV cache \(128 tokens\)"):
        core.add_request(req(ids=[5] * 100, max_tokens=50))
    assert not core.seqs


def test_duplicate_request_id(core):
    core.add_request(req(rid="twice"))
    try:
        with pytest.raises(InvalidRequestError, match="'twice' is already in use"):
            core.add_request(req(rid="twice"))
    finally:
        core.end_request("twice", "abort")
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


def test_bad_engine_settings():
    with pytest.raises(ModelNotFoundError, match="/no/such/model"):
        LLM(model="/no/such/model")
    with pytest.raises(ModelNotFoundError, match="/no/such/model"):
        asyncio.run(NativeEngine(EngineConfig(model="/no/such/model")).start())
    with pytest.raises(ValueError, match="dtype 'int8'"):
        EngineCore(EngineConfig(dtype="int8"))
    with pytest.raises(ValueError, match="max_model_len 100000 exceeds the model's context"):
        EngineCore(EngineConfig(max_model_len=100000))


async def test_engine_rejects_before_streaming_and_before_start():
    engine = NativeEngine(EngineConfig(num_kv_blocks=8))
    with pytest.raises(RuntimeError, match="not started"):
        await anext(engine.generate(req(), RequestContext("r")))
    await engine.start()
    try:
        with pytest.raises(InvalidRequestError, match="temperature"):
            await anext(engine.generate(req(temperature=-1), RequestContext("r")))
        # The engine still serves after a rejection.
        outs = [o async for o in engine.generate(req(temperature=0), RequestContext("ok"))]
        assert outs[-1].finish_reason in ("stop", "length")
    finally:
        await engine.stop()


def test_llm_rejects_a_bad_prompt_before_any_work():
    llm = LLM(num_kv_blocks=8, max_model_len=64)
    with pytest.raises(PromptTooLongError):
        llm.generate(["hello", "word " * 100], SamplingParams(temperature=0), StopConditions(max_tokens=4))
    assert not llm.core.seqs
    assert [len(r.token_ids) for r in llm.generate(["hello"], SamplingParams(temperature=0),
                                                   StopConditions(max_tokens=3, ignore_eos=True))] == [3]
