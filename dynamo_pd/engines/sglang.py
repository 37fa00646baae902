"""SGLang behind the engine contract (`sglang.Engine`, its offline engine API; needs an NVIDIA GPU).

Prompts go in as input_ids. SGLang streams cumulatively (output_ids, text and logprobs so far); this
engine sends deltas, holding back text that could still become a stop string (SGLang would trim it
only at the end). Disaggregation is SGLang's own: PREFILL and DECODE engines run with
disaggregation_mode prefill / decode and move KV over NIXL (default) or Mooncake
(`--disaggregation-transfer-backend mooncake`). A prefill worker offers its bootstrap server's host and
port (`handoff_offer`); the frontend sends that offer to prefill and decode at once, and both derive the
bootstrap room from the request id. SGLang's prefill stream ends once the KV is sent; the decode stream
carries every token, the first one included (`first_token_from_decode`).
KV events are SGLang's own ZMQ publisher (kv_events_config, with its replay socket): batches
[ts, events, dp_rank] of map-tagged BlockStored / BlockRemoved / AllBlocksCleared, which router.events
reads as it reads vLLM's; page_size is the block size, so each BlockStored is one router block.
Traced (dynamo_pd.tracing), SGLang exports its own request spans to the same collector, under the
worker's span (`external_trace_header`), unless `extra` sets enable_trace itself.
Every other key of `EngineConfig.extra` goes to ServerArgs untouched.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
from collections.abc import AsyncIterator
from typing import Any

import sglang
from sglang.srt.server_args import ServerArgs

from dynamo_pd import tracing
from dynamo_pd.engines.base import Engine, EngineConfig, EngineRole, EngineUnavailableError
from dynamo_pd.guided import JSON_OBJECT, KINDS, choice_ebnf
from dynamo_pd.handoff_kinds import EngineHandoff
from dynamo_pd.model_store import resolve_model
from dynamo_pd.protocol import EngineOutput, EngineRequest, Guided, TokenLogprob, Usage
from dynamo_pd.runtime import RequestContext
from dynamo_pd.runtime.ports import free_port

# transfer backend -> (module it needs, how to install it)
TRANSFER_BACKENDS = {
    "nixl": ("nixl", "pip install nixl"),
    "mooncake": ("mooncake", "pip install mooncake-transfer-engine"),
}


class SglangEngine(Engine):
    publishes_kv_events = True  # SGLang's own ZMQ publisher; KV moves through its transfer backend
    guided_kinds = KINDS  # in its sampling params (guided_sampling below), on its xgrammar backend
    logit_bias = True  # its SamplingParams.logit_bias

    def __init__(self, config: EngineConfig):
        self.config = config
        self.role = config.role
        self._engine: Any = None  # sglang.Engine
        self.server_args = self._server_args()

    def _server_args(self) -> ServerArgs:
        cfg = self.config
        extra = dict(cfg.extra)
        events_endpoint = extra.pop("kv_events_endpoint", None)
        replay_endpoint = extra.pop("kv_events_replay_endpoint", None)
        if extra.get("incremental_streaming_output"):
            raise ValueError("--incremental-streaming-output: this engine reads SGLang's cumulative stream")
        device, _, gpu = cfg.device.partition(":")
        kwargs: dict[str, Any] = dict(
            model_path=str(resolve_model(cfg.model)),
            device=device,
            dtype=cfg.dtype,
            page_size=cfg.block_size,
            max_running_requests=cfg.max_num_seqs,
            chunked_prefill_size=cfg.max_num_batched_tokens,
            context_length=cfg.max_model_len,
            disable_radix_cache=not cfg.enable_prefix_caching,
            random_seed=cfg.seed,
        )
        if gpu:
            kwargs["base_gpu_id"] = int(gpu)
        if "gpu_memory_utilization" in extra:  # serve splits this between its workers; SGLang's name for it
            kwargs["mem_fraction_static"] = extra.pop("gpu_memory_utilization")
        if events_endpoint:
            kwargs["kv_events_config"] = json.dumps({"publisher": "zmq", "endpoint": events_endpoint,
                                                    "replay_endpoint": replay_endpoint, "topic": ""})
        if cfg.role is not EngineRole.AGGREGATED:
            backend = extra.pop("disaggregation_transfer_backend", "nixl")
            if backend not in TRANSFER_BACKENDS:
                raise ValueError(f"--disaggregation-transfer-backend must be one of {', '.join(TRANSFER_BACKENDS)}, "
                                 f"got {backend!r}")
            module, install = TRANSFER_BACKENDS[backend]
            if importlib.util.find_spec(module) is None:
                raise EngineUnavailableError(f"SGLang {cfg.role.value} workers move KV with {backend}, which is not "
                                             f"installed: {install}")
            kwargs.update(disaggregation_mode=cfg.role.value, disaggregation_transfer_backend=backend)
            if cfg.role is EngineRole.PREFILL:
                # the default (8998) would collide with a second prefill worker on this host
                kwargs["disaggregation_bootstrap_port"] = (
                    extra.pop("disaggregation_bootstrap_port", None) or free_port()
                )
        if tracing.enabled():
            kwargs.update(enable_trace=True, otlp_traces_endpoint=tracing.config().traces_url,
                          otlp_service_name=f"sglang-{cfg.role.value}")
        kwargs.update(extra)
        return ServerArgs(**kwargs)

    async def start(self) -> None:
        if self.server_args.enable_trace:  # SGLang's exporter speaks gRPC unless told otherwise; ours is HTTP
            os.environ.setdefault("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        # Built on the event loop's thread: its tokenizer manager serves requests on this loop.
        self._engine = sglang.Engine(server_args=self.server_args)

    @property
    def max_model_len(self) -> int:
        assert self._engine is not None, "start() the engine first"
        return self._engine.tokenizer_manager.context_len

    async def stop(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None

    def handoff_offer(self) -> EngineHandoff | None:
        if self.role is not EngineRole.PREFILL:
            return None
        args = self.server_args
        return EngineHandoff(params={"bootstrap_host": args.host, "bootstrap_port": args.disaggregation_bootstrap_port},
                             first_token_from_decode=True)

    def generate_args(self, request: EngineRequest) -> dict[str, Any]:
        """Engine.async_generate's keyword arguments for `request`."""
        s, stop = request.sampling, request.stop
        sampling: dict[str, Any] = dict(
            max_new_tokens=stop.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else -1,
            repetition_penalty=s.repetition_penalty,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            stop=list(stop.stop) or None,
            stop_token_ids=list(stop.stop_token_ids) or None,
            ignore_eos=stop.ignore_eos,
            sampling_seed=s.seed,
            logit_bias={str(token): bias for token, bias in s.logit_bias.items()} or None,  # its keys: strings
            **guided_sampling(s.guided),
        )
        args: dict[str, Any] = dict(input_ids=list(request.prompt_token_ids), sampling_params=sampling, stream=True,
                                    rid=request.request_id, cache_salt=request.cache_salt)
        if s.logprobs is not None:
            args.update(return_logprob=True, top_logprobs_num=s.logprobs)
        if self.role is not EngineRole.AGGREGATED:
            args.update(bootstrap_args(request, self.role))
        return args

    async def generate(self, request: EngineRequest, context: RequestContext) -> AsyncIterator[EngineOutput]:
        assert self._engine is not None, "start() the engine first"
        request.validate()
        rid = request.request_id
        args = self.generate_args(request)
        if context.metadata:  # the worker's span, when traced
            args["external_trace_header"] = context.metadata
        stream = await self._engine.async_generate(**args)
        reader = StreamReader(request, self.role)
        try:
            async with contextlib.aclosing(context.until_cancelled(stream)) as outs:
                async for out in outs:
                    if out is None:
                        self._engine.tokenizer_manager.abort_request(rid=rid)
                        yield EngineOutput(request_id=rid, token_ids=[], finish_reason="abort")
                        return
                    yield reader.read(out)
                    if reader.finished:
                        return
        finally:
            await stream.aclose()


def bootstrap_room(request_id: str) -> int:
    """The room both sides of a hand-off key on: a non-zero 63-bit integer from the request id."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 1) or 1


def bootstrap_args(request: EngineRequest, role: EngineRole) -> dict[str, Any]:
    """PREFILL / DECODE: where the prefill's bootstrap server is and the room, from the offered hand-off."""
    handoff = request.handoff
    if not isinstance(handoff, EngineHandoff) or "bootstrap_port" not in handoff.params or not handoff.request_id:
        raise ValueError(f"SGLang {role.value} request {request.request_id!r} needs the bootstrap hand-off its "
                         f"prefill worker offers, sent to prefill and decode together; got {handoff!r}")
    return dict(bootstrap_host=handoff.params["bootstrap_host"], bootstrap_port=handoff.params["bootstrap_port"],
                bootstrap_room=bootstrap_room(handoff.request_id))


def guided_sampling(guided: Guided | None) -> dict[str, str]:
    """SGLang's sampling params for `guided`: json_schema, regex, ebnf (a choice as its grammar) or
    structural_tag."""
    if guided is None:
        return {}
    if guided.kind == "json_object":
        return {"json_schema": JSON_OBJECT}
    if guided.kind == "choice":
        return {"ebnf": choice_ebnf(json.loads(guided.spec))}
    return {{"grammar": "ebnf"}.get(guided.kind, guided.kind): guided.spec}


class StreamReader:
    """SGLang's cumulative output dicts of one request -> EngineOutput deltas."""

    def __init__(self, request: EngineRequest, role: EngineRole):
        self.request, self.role = request, role
        self.finished = False
        self._tokens = self._chars = 0  # how much of the cumulative output went out
        # text a stop string could still claim waits until the next output or the end
        self._holdback = max((len(s) for s in request.stop.stop), default=1) - 1

    def read(self, out: dict[str, Any]) -> EngineOutput:
        meta = out["meta_info"]
        reason = meta.get("finish_reason")
        self.finished = reason is not None
        ids = out["output_ids"]
        text = out.get("text") or ""
        shown = text if self.finished else text[:max(self._chars, len(text) - self._holdback)]
        result = EngineOutput(request_id=self.request.request_id, token_ids=list(ids[self._tokens:]),
                              text=shown[self._chars:])
        if self.request.sampling.logprobs is not None:
            result.logprobs = _logprobs(meta, self._tokens, len(ids))
        self._tokens, self._chars = len(ids), max(self._chars, len(shown))
        if not self.finished:
            return result
        kind = reason["type"]
        result.usage = Usage(prompt_tokens=meta["prompt_tokens"], completion_tokens=meta["completion_tokens"],
                             cached_tokens=meta.get("cached_tokens") or 0)
        if kind == "abort":
            result.finish_reason, result.error = "error", reason.get("message") or "aborted by SGLang"
        elif self.role is EngineRole.PREFILL:  # the KV went to the decode side, which streams every token
            result.finish_reason, result.handoff = "prefill_done", self.request.handoff
        else:
            result.finish_reason = "stop" if kind == "stop" else "length"
            result.stop_reason = reason.get("matched") if kind == "stop" else None
        return result


def _logprobs(meta: dict[str, Any], start: int, end: int) -> list[TokenLogprob]:
    # entries are (logprob, token_id, text); a top-k entry is None when none was asked for
    chosen = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or []
    result = []
    for i in range(start, min(end, len(chosen))):
        logprob, token_id = chosen[i][0], chosen[i][1]
        top = sorted(((t[1], t[0]) for t in (tops[i] if i < len(tops) and tops[i] else [])), key=lambda t: -t[1])
        result.append(TokenLogprob(token_id=token_id, logprob=logprob, top=top))
    return result
