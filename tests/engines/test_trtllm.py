"""TensorRT-LLM behind the contract. Its package cannot install here, so the translation runs against fakes
shaped exactly like its classes, installed as `tensorrt_llm.llmapi` for the duration of each test:

- DisaggregatedParams: tensorrt_llm/disaggregated_params.py @ 01009a33a704c61e2c183c40514d7fb59159ab09
- SamplingParams (its fields), KvCacheConfig / CacheTransceiverConfig (pydantic, extra fields forbidden):
  tensorrt_llm/sampling_params.py @ 000a01de66f0eab4ab05640711f0253f50f5209c, tensorrt_llm/llmapi/llm_args.py
- LLM.generate_async(inputs, sampling_params, lora_request, prompt_adapter_request, streaming,
  kv_cache_retention_config, disaggregated_params, _postproc_params, scheduling_params, cache_salt),
  get_kv_cache_events_async(timeout): tensorrt_llm/llmapi/llm.py @ 4c05a74891e4df8066f08ed4ce14b0972abe4e25
- RequestOutput / CompletionOutput (cumulative token_ids, text, logprobs; finished; abort()), IterationResult
  (ends after `timeout` without an event): tensorrt_llm/executor/result.py @ 005bc848893f575ec14b45d6b13139360d67c790
- KV event dicts: tensorrt_llm/_utils.py KVCacheEventSerializer
test_real_engine runs the real engine where tensorrt_llm is installed (an NVIDIA GPU)."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import importlib.util
import sys
import types
from typing import Any, Literal, Optional

import msgspec
import pydantic
import pytest

from dynamo_pd.engines.base import EngineConfig, EngineRole
from dynamo_pd.handoff_kinds import EngineHandoff
from dynamo_pd.protocol import EngineOutput, EngineRequest, SamplingParams, StopConditions
from dynamo_pd.runtime import RequestContext
from router.events import BlockRemoved, BlockStored, decode_batch, encode_batch


@dataclasses.dataclass(slots=True, kw_only=True)
class DisaggregatedParams:
    request_type: Optional[str] = None
    first_gen_tokens: Optional[list[int]] = None
    first_gen_log_probs: Optional[list] = None
    first_gen_logits: Optional[list] = None
    ctx_request_id: Optional[int] = None
    opaque_state: Optional[bytes] = None
    draft_tokens: Optional[list[int]] = None
    disagg_request_id: Optional[int] = None
    ctx_dp_rank: Optional[int] = None
    ctx_info_endpoint: Optional[str] = None
    schedule_style: Optional[int] = None
    multimodal_embedding_handles: Optional[list] = None
    multimodal_hashes: Optional[list] = None
    mrope_position_ids_handle: Optional[dict] = None
    mrope_position_deltas_handle: Optional[dict] = None

    def __post_init__(self):
        if self.request_type not in (None, "context_only", "generation_only", "context_and_generation"):
            raise ValueError(f"Unknown request type: {self.request_type}")


@dataclasses.dataclass(kw_only=True)
class GuidedDecodingParams:  # tensorrt_llm/sampling_params.py: one of its fields guides
    json: Optional[str] = None
    regex: Optional[str] = None
    grammar: Optional[str] = None
    json_object: bool = False
    structural_tag: Optional[str] = None


@dataclasses.dataclass(kw_only=True)
class TrtSamplingParams:  # the fields this engine may set, as the real dataclass names them
    end_id: Optional[int] = None
    max_tokens: int = 32
    stop: Optional[list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    temperature: Optional[float] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logprobs: Optional[int] = None
    ignore_eos: bool = False
    guided_decoding: Optional[GuidedDecodingParams] = None


class KvCacheConfig(pydantic.BaseModel, extra="forbid"):
    enable_block_reuse: bool = True
    max_tokens: Optional[int] = None
    free_gpu_memory_fraction: Optional[float] = None
    event_buffer_max_size: int = 0
    tokens_per_block: int = 32


class CacheTransceiverConfig(pydantic.BaseModel, extra="forbid"):
    backend: Optional[Literal["DEFAULT", "UCX", "NIXL", "MOONCAKE", "MPI"]] = None
    max_tokens_in_buffer: Optional[int] = None
    kv_transfer_timeout_ms: Optional[pydantic.PositiveInt] = None


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Any = None
    disaggregated_params: Optional[DisaggregatedParams] = None


class RequestOutput:
    """Async-iterable like GenerationResult: each step updates the one cumulative CompletionOutput."""

    def __init__(self, steps: list[dict], hang: bool):
        self.outputs = [CompletionOutput(0)]
        self.finished, self.aborted = False, False
        self._steps, self._hang = list(steps), hang

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.finished:
            raise StopAsyncIteration
        if not self._steps:
            LLM.hanging.set()
            await asyncio.Event().wait()  # a request that never finishes
        step = self._steps.pop(0)
        for key, value in step.items():
            setattr(self.outputs[0], key, value)
        self.finished = step.get("finish_reason") is not None
        return self

    def abort(self):
        self.aborted = True


class IterationResult:
    def __init__(self, events: list[dict], timeout: float):
        self._events, self._timeout = events, timeout

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._events:
            LLM.events_taken.set()  # the caller asks again: it has handled every event before
            await asyncio.sleep(self._timeout)  # TRT-LLM's own wait: the iteration ends after `timeout`
            raise StopAsyncIteration
        return self._events.pop(0)


class LLM:
    instances: list["LLM"] = []
    steps: list[dict] = []
    events: list[dict] = []
    hanging: asyncio.Event  # a request streamed every step and waits forever (steps ran out)
    events_taken: asyncio.Event  # the KV event iteration was asked past its last event

    def __init__(self, model: str, **kwargs):
        self.model, self.kwargs, self.calls, self.results = model, kwargs, [], []
        self.args = types.SimpleNamespace(max_seq_len=kwargs.get("max_seq_len") or 8192)
        LLM.instances.append(self)

    def generate_async(self, inputs, sampling_params=None, lora_request=None, prompt_adapter_request=None,
                       streaming=False, kv_cache_retention_config=None, disaggregated_params=None,
                       _postproc_params=None, scheduling_params=None, cache_salt=None):
        self.calls.append(dict(inputs=inputs, sampling_params=sampling_params, streaming=streaming,
                               disaggregated_params=disaggregated_params, cache_salt=cache_salt))
        self.results.append(RequestOutput(LLM.steps, hang=not LLM.steps))
        return self.results[-1]

    def get_kv_cache_events_async(self, timeout: Optional[float] = 2):
        events, LLM.events = LLM.events, []
        return IterationResult(events, timeout)

    def shutdown(self):
        pass


@pytest.fixture
def trtllm(monkeypatch):
    """dynamo_pd.engines.trtllm imported against the fake `tensorrt_llm.llmapi`."""
    package, llmapi = types.ModuleType("tensorrt_llm"), types.ModuleType("tensorrt_llm.llmapi")
    llmapi.LLM, llmapi.SamplingParams, llmapi.DisaggregatedParams = LLM, TrtSamplingParams, DisaggregatedParams
    llmapi.KvCacheConfig, llmapi.CacheTransceiverConfig = KvCacheConfig, CacheTransceiverConfig
    llmapi.GuidedDecodingParams = GuidedDecodingParams
    package.llmapi = llmapi
    monkeypatch.setitem(sys.modules, "tensorrt_llm", package)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi", llmapi)
    monkeypatch.delitem(sys.modules, "dynamo_pd.engines.trtllm", raising=False)
    LLM.instances, LLM.steps, LLM.events = [], [], []
    LLM.hanging, LLM.events_taken = asyncio.Event(), asyncio.Event()
    yield importlib.import_module("dynamo_pd.engines.trtllm")
    sys.modules.pop("dynamo_pd.engines.trtllm", None)


def engine(trtllm, role: EngineRole, **extra):
    return trtllm.TrtllmEngine(EngineConfig(role=role, block_size=16, max_num_seqs=8, max_num_batched_tokens=512,
                                            extra=extra))


def request(**kw) -> EngineRequest:
    kw.setdefault("sampling", SamplingParams(temperature=0.7, top_k=0, seed=5, logprobs=1))
    kw.setdefault("stop", StopConditions(max_tokens=8, stop=["."]))
    return EngineRequest(request_id="r-1", prompt_token_ids=[1, 2, 3], cache_salt="t", **kw)


def test_llm_args(trtllm):
    args = engine(trtllm, EngineRole.PREFILL, gpu_memory_utilization=0.3, enable_chunked_prefill=True).llm_args()
    assert args["kv_cache_config"].model_dump(exclude_none=True) == dict(
        enable_block_reuse=True, tokens_per_block=16, event_buffer_max_size=1024, free_gpu_memory_fraction=0.3)
    transceiver = args["cache_transceiver_config"]
    assert transceiver.backend == "NIXL" and transceiver.kv_transfer_timeout_ms > 30_000  # past the hand-off lease
    assert (args["backend"], args["max_batch_size"], args["max_num_tokens"], args["enable_chunked_prefill"]) == (
        "pytorch", 8, 512, True)
    assert engine(trtllm, EngineRole.DECODE, cache_transceiver_backend="ucx").llm_args()[
        "cache_transceiver_config"].backend == "UCX"
    assert "cache_transceiver_config" not in engine(trtllm, EngineRole.AGGREGATED).llm_args()
    with pytest.raises(ValueError, match="NIXL or UCX"):
        engine(trtllm, EngineRole.DECODE, cache_transceiver_backend="tcp").llm_args()


def test_sampling_params(trtllm):
    e = engine(trtllm, EngineRole.AGGREGATED)
    sampled = e.sampling_params(request())
    assert (sampled.temperature, sampled.top_k, sampled.seed, sampled.logprobs, sampled.stop) == (
        0.7,
        None,
        5,
        1,
        ["."],
    )
    greedy = e.sampling_params(request(sampling=SamplingParams(temperature=0)))
    assert (greedy.top_k, greedy.temperature) == (1, None)


def context_steps(params: DisaggregatedParams) -> list[dict]:
    return [dict(token_ids=[9], text="Hi", logprobs=[{9: Logprob(-0.2, 1), 4: Logprob(-1.9, 2)}],
                 finish_reason="length", disaggregated_params=params)]


async def generate(e, req, context=None) -> list[EngineOutput]:
    return [o async for o in e.generate(req, context or RequestContext(req.request_id))]


async def test_prefill_then_decode_carry_the_opaque_state(trtllm):
    prefill, decode = engine(trtllm, EngineRole.PREFILL), engine(trtllm, EngineRole.DECODE)
    await prefill.start()
    await decode.start()
    returned = DisaggregatedParams(request_type="context_only", first_gen_tokens=[9], ctx_request_id=77,
                                   opaque_state=b"\x00state", draft_tokens=None)
    LLM.steps = context_steps(returned)
    [first] = await generate(prefill, request())
    sent = LLM.instances[0].calls[0]
    assert sent["disaggregated_params"].request_type == "context_only" and sent["streaming"]
    assert sent["inputs"] == [1, 2, 3] and sent["cache_salt"] == "t"
    assert (first.finish_reason, first.token_ids, first.handoff.first_token_from_decode) == ("prefill_done", [9], True)
    assert isinstance(first.handoff, EngineHandoff) and "first_gen_log_probs" not in first.handoff.params
    assert [(lp.token_id, lp.logprob, lp.top) for lp in first.logprobs] == [(9, -0.2, [(9, -0.2), (4, -1.9)])]
    # the hand-off crosses the request plane as msgpack, opaque bytes included
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(first), type=EngineOutput)
    LLM.steps = [dict(token_ids=[9, 10], text="Hi there"),
                 dict(token_ids=[9, 10, 11], text="Hi there.", finish_reason="stop", stop_reason=".")]
    outs = await generate(decode, request(handoff=wire.handoff, first_token_id=9))
    got = LLM.instances[1].calls[0]["disaggregated_params"]
    assert (got.request_type, got.ctx_request_id, got.opaque_state, got.first_gen_tokens) == (
        "generation_only", 77, b"\x00state", [9])
    assert [o.token_ids for o in outs] == [[9, 10], [11]] and "".join(o.text for o in outs) == "Hi there."
    assert (outs[-1].finish_reason, outs[-1].stop_reason, outs[-1].usage.completion_tokens) == ("stop", ".", 3)
    await prefill.stop()
    await decode.stop()


async def test_a_one_token_answer_is_no_handoff(trtllm):
    prefill = engine(trtllm, EngineRole.PREFILL)
    await prefill.start()
    LLM.steps = [dict(token_ids=[2], text="", finish_reason="length")]
    [out] = await generate(prefill, request(stop=StopConditions(max_tokens=1)))
    assert LLM.instances[0].calls[0]["disaggregated_params"] is None  # nothing held for a decode side
    assert (out.finish_reason, out.handoff) == ("length", None)
    with pytest.raises(ValueError, match="EngineHandoff"):
        engine(trtllm, EngineRole.DECODE).disaggregated_params(request(handoff=object()))
    await prefill.stop()


async def test_cancel_aborts(trtllm):
    e = engine(trtllm, EngineRole.AGGREGATED)
    await e.start()
    context = RequestContext("r-1")
    task = asyncio.ensure_future(generate(e, request(), context))
    await asyncio.wait_for(LLM.hanging.wait(), 5)  # cancelled while TRT-LLM runs the request
    context.cancel()
    outs = await asyncio.wait_for(task, 5)
    assert outs[-1].finish_reason == "abort" and LLM.instances[0].results[0].aborted
    await e.stop()


async def test_kv_events_reach_the_wire_format(trtllm):
    tokens = [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in range(32)]
    LLM.events = [
        {"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [100, 0]}, "window_size": 32},
        {"event_id": 1, "data": {"type": "stored", "parent_hash": None, "blocks": [
            {"type": "stored_block", "block_hash": 5, "tokens": tokens[:16], "cache_level": 0, "priority": 35},
            {"type": "stored_block", "block_hash": 6, "tokens": tokens[16:], "cache_level": 0, "priority": 35}]},
         "window_size": 32},
        {"event_id": 2, "data": {"type": "removed", "block_hashes": [6]}, "window_size": 32},
    ]
    e = engine(trtllm, EngineRole.AGGREGATED)
    await e.start()
    await asyncio.wait_for(LLM.events_taken.wait(), 5)
    events = e.drain_kv_events()
    await e.stop()
    batch, skipped = decode_batch(encode_batch(events))
    assert skipped == 0 and batch.events == [
        BlockStored(block_hashes=[5, 6], parent_block_hash=None, token_ids=list(range(32)), block_size=16),
        BlockRemoved(block_hashes=[6])]


@pytest.mark.slow
@pytest.mark.hardware
@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is None,
                    reason="needs tensorrt_llm (NVIDIA GPU; pip install tensorrt_llm from NVIDIA's index)")
async def test_real_engine():
    sys.modules.pop("dynamo_pd.engines.trtllm", None)
    from dynamo_pd.engines.trtllm import TrtllmEngine

    e = TrtllmEngine(EngineConfig(role=EngineRole.AGGREGATED, device="cuda", dtype="bfloat16"))
    await e.start()
    try:
        req = EngineRequest(request_id="real-1", prompt_token_ids=[1, 504, 3458, 282, 4649, 314],
                            sampling=SamplingParams(temperature=0), stop=StopConditions(max_tokens=8))
        outs = await generate(e, req)
        assert sum(len(o.token_ids) for o in outs) == 8 and outs[-1].finish_reason == "length"
    finally:
        await e.stop()
