"""TensorRT-LLM behind the engine contract (its LLM API, PyTorch backend; needs an NVIDIA GPU).

Written against NVIDIA/TensorRT-LLM's own source: tensorrt_llm/llmapi/llm.py (LLM.generate_async(inputs,
sampling_params, ..., streaming, ..., disaggregated_params, ..., cache_salt), get_kv_cache_events_async),
tensorrt_llm/disaggregated_params.py (DisaggregatedParams), tensorrt_llm/executor/result.py (cumulative
CompletionOutput: token_ids, text, logprobs as dicts token -> Logprob, finish_reason, stop_reason,
disaggregated_params; GenerationResult.abort()) and tensorrt_llm/llmapi/llm_args.py (KvCacheConfig,
CacheTransceiverConfig).

Disaggregation is TensorRT-LLM's own, pull-like: a PREFILL request is "context_only"; its output's
DisaggregatedParams (ctx_request_id, opaque_state, first_gen_tokens, ...) travel in an EngineHandoff to the
decode worker, whose "generation_only" request has its cache transceiver (NIXL, or UCX with
`--cache-transceiver-backend UCX`) fetch the KV. The decode stream carries every token, the first included.
KV events: get_kv_cache_events_async's dicts ("stored" / "removed") become router events, which the worker
publishes (drain_kv_events). Every other key of `EngineConfig.extra` goes to LLM(...) untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from tensorrt_llm.llmapi import (
    LLM, CacheTransceiverConfig, DisaggregatedParams, GuidedDecodingParams, KvCacheConfig, SamplingParams,
)

from dynamo_pd.engines.base import Engine, EngineConfig, EngineRole
from dynamo_pd.guided import KINDS, choice_ebnf
from dynamo_pd.handoff_kinds import EngineHandoff
from dynamo_pd.model_store import resolve_model
from dynamo_pd.protocol import EngineOutput, EngineRequest, Guided, TokenLogprob, Usage
from dynamo_pd.runtime import RequestContext
from dynamo_pd.runtime.tasks import cancel_and_wait
from router.events import BlockRemoved, BlockStored, KVEvent

# DisaggregatedParams' P-D fields a context-only output returns and a generation-only request takes back
HANDOFF_FIELDS = ("first_gen_tokens", "ctx_request_id", "opaque_state", "draft_tokens", "disagg_request_id",
                  "ctx_dp_rank", "ctx_info_endpoint")
_EVENTS_POLL_S = 0.5  # get_kv_cache_events_async ends after this long without an event; then ask again


class TrtllmEngine(Engine):
    guided_kinds = KINDS  # as its GuidedDecodingParams (guided_decoding below), on llm_args' xgrammar backend
    def __init__(self, config: EngineConfig):
        self.config = config
        self.role = config.role
        self._llm: Any = None
        self._events: list[KVEvent] = []
        self._events_task: asyncio.Task | None = None

    def llm_args(self) -> dict[str, Any]:
        cfg = self.config
        extra = dict(cfg.extra)
        kv_cache = dict(enable_block_reuse=cfg.enable_prefix_caching, tokens_per_block=cfg.block_size,
                        event_buffer_max_size=1024 if cfg.enable_prefix_caching else 0)
        if "gpu_memory_utilization" in extra:  # serve splits this between its workers
            kv_cache["free_gpu_memory_fraction"] = extra.pop("gpu_memory_utilization")
        args: dict[str, Any] = dict(
            model=str(resolve_model(cfg.model)),
            backend="pytorch",
            dtype="auto"
            if cfg.dtype == "float32"
            else cfg.dtype,  # float32 is the CPU default here; the GPU runs the model's
            max_batch_size=cfg.max_num_seqs,
            max_num_tokens=cfg.max_num_batched_tokens,
            max_seq_len=cfg.max_model_len,
            kv_cache_config=KvCacheConfig(**kv_cache),
            guided_decoding_backend="xgrammar",  # without a backend, guided_decoding params are not enforced
        )
        if cfg.role is not EngineRole.AGGREGATED:
            backend = str(extra.pop("cache_transceiver_backend", "NIXL")).upper()
            if backend not in ("NIXL", "UCX"):
                raise ValueError(f"--cache-transceiver-backend must be NIXL or UCX, got {backend!r}")
            # a context's KV waits this long for its generation side, then TensorRT-LLM frees it
            timeout_ms = int(cfg.handoff.engine_lease_s * 1000)
            args["cache_transceiver_config"] = CacheTransceiverConfig(
                backend=backend, kv_transfer_timeout_ms=timeout_ms
            )
        args.update(extra)
        return args

    async def start(self) -> None:
        self._llm = await asyncio.to_thread(LLM, **self.llm_args())
        if self.config.enable_prefix_caching:
            self._events_task = asyncio.create_task(self._follow_kv_events())

    @property
    def max_model_len(self) -> int:
        assert self._llm is not None, "start() the engine first"
        return self._llm.args.max_seq_len

    async def stop(self) -> None:
        if self._events_task is not None:
            await cancel_and_wait([self._events_task])
        if self._llm is not None:
            await asyncio.to_thread(self._llm.shutdown)
            self._llm = None

    def sampling_params(self, request: EngineRequest) -> SamplingParams:
        s, stop = request.sampling, request.stop
        # greedy is top_k 1 in TensorRT-LLM (its temperature must be > 0)
        sampling = dict(top_k=1) if s.greedy else dict(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or None)
        return SamplingParams(
            max_tokens=stop.max_tokens,
            **sampling,
            seed=s.seed,
            repetition_penalty=s.repetition_penalty,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            logprobs=s.logprobs,
            stop=list(stop.stop) or None,
            stop_token_ids=list(stop.stop_token_ids) or None,
            ignore_eos=stop.ignore_eos,
            guided_decoding=guided_decoding(s.guided),
        )

    def disaggregated_params(self, request: EngineRequest) -> DisaggregatedParams | None:
        """PREFILL: context only (unless the first token is the whole answer); DECODE: generation only,
        with the state the prefill's output carried."""
        if self.role is EngineRole.PREFILL and request.stop.max_tokens > 1:
            return DisaggregatedParams(request_type="context_only")
        if self.role is EngineRole.DECODE and request.handoff is not None:
            if not isinstance(request.handoff, EngineHandoff):
                raise ValueError(f"a TensorRT-LLM decode worker takes an EngineHandoff, got {request.handoff!r}")
            return DisaggregatedParams(request_type="generation_only", **request.handoff.params)
        return None

    async def generate(self, request: EngineRequest, context: RequestContext) -> AsyncIterator[EngineOutput]:
        assert self._llm is not None, "start() the engine first"
        request.validate()
        disaggregated = self.disaggregated_params(request)
        result = self._llm.generate_async(list(request.prompt_token_ids), self.sampling_params(request),
                                          streaming=True, disaggregated_params=disaggregated,
                                          cache_salt=request.cache_salt)
        reader = OutputReader(request, context_only=disaggregated is not None and self.role is EngineRole.PREFILL)
        async with contextlib.aclosing(context.until_cancelled(result)) as outs:
            async for out in outs:
                if out is None:
                    result.abort()
                    yield EngineOutput(request_id=request.request_id, token_ids=[], finish_reason="abort")
                    return
                yield reader.read(out)
                if out.finished:
                    return

    async def release_handoff(self, request_id: str) -> None:
        # The cache transceiver frees the context's KV once the generation side has it (or its timeout passed).
        return None

    def drain_kv_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    async def _follow_kv_events(self) -> None:
        while True:
            async for event in self._llm.get_kv_cache_events_async(timeout=_EVENTS_POLL_S):
                self._events.extend(kv_events(event, self.config.block_size))
            await asyncio.sleep(0.01)  # the iterable ends on a quiet spell; ask again


def kv_events(event: dict[str, Any], block_size: int) -> list[KVEvent]:
    """One of TensorRT-LLM's serialized KV cache events (tensorrt_llm/_utils.py KVCacheEventSerializer) as
    router events. "created" (the pool's size) and "updated" (priority, cache level) change no prefix."""
    data = event["data"]
    if data["type"] == "stored":
        blocks = data["blocks"]
        return [BlockStored(block_hashes=[b["block_hash"] for b in blocks], parent_block_hash=data["parent_hash"],
                            token_ids=[t["token_id"] for b in blocks for t in b["tokens"]], block_size=block_size)]
    if data["type"] == "removed":
        return [BlockRemoved(block_hashes=list(data["block_hashes"]))]
    return []


def guided_decoding(guided: Guided | None) -> GuidedDecodingParams | None:
    """TensorRT-LLM's form of `guided` (a choice as its EBNF grammar)."""
    if guided is None:
        return None
    if guided.kind == "json_schema":
        return GuidedDecodingParams(json=guided.spec)
    if guided.kind == "json_object":
        return GuidedDecodingParams(json_object=True)
    if guided.kind == "choice":
        return GuidedDecodingParams(grammar=choice_ebnf(json.loads(guided.spec)))
    return GuidedDecodingParams(**{guided.kind: guided.spec})  # regex, grammar, structural_tag


class OutputReader:
    """One request's cumulative RequestOutputs -> EngineOutput deltas."""

    def __init__(self, request: EngineRequest, context_only: bool):
        self.request, self.context_only = request, context_only
        self._tokens = self._chars = 0

    def read(self, out: Any) -> EngineOutput:
        completion = out.outputs[0]
        ids, text = list(completion.token_ids), completion.text
        result = EngineOutput(request_id=self.request.request_id, token_ids=ids[self._tokens:],
                              text=text[self._chars:])
        if self.request.sampling.logprobs is not None:
            result.logprobs = [_logprob(token, alternatives) for token, alternatives
                               in zip(ids[self._tokens:], (completion.logprobs or [])[self._tokens:])]
        self._tokens, self._chars = len(ids), len(text)
        if not out.finished:
            return result
        result.usage = Usage(prompt_tokens=len(self.request.prompt_token_ids), completion_tokens=len(ids))
        params = completion.disaggregated_params
        if self.context_only and params is not None and completion.finish_reason != "stop":
            result.finish_reason, result.handoff = "prefill_done", handoff(params)
        else:
            result.finish_reason = {"stop": "stop", "length": "length", "cancelled": "abort"}.get(
                completion.finish_reason, "error")
            result.stop_reason = completion.stop_reason
            if result.finish_reason == "error":
                result.error = f"TensorRT-LLM finished the request with {completion.finish_reason!r}"
        return result


def handoff(params: DisaggregatedParams) -> EngineHandoff:
    """A context-only output's DisaggregatedParams -> the hand-off its decode worker is sent."""
    fields = {name: getattr(params, name) for name in HANDOFF_FIELDS}
    return EngineHandoff(params={k: v for k, v in fields.items() if v is not None}, first_token_from_decode=True)


def _logprob(token_id: int, alternatives: dict[int, Any]) -> TokenLogprob:
    top = sorted(((tid, lp.logprob) for tid, lp in alternatives.items()), key=lambda t: -t[1])
    chosen = alternatives.get(token_id)
    return TokenLogprob(token_id=token_id, logprob=chosen.logprob if chosen else float("nan"), top=top)
