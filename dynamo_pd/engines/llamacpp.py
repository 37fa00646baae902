"""llama.cpp (llama-cpp-python) behind the engine contract: GGUF models on CPU.

One llama.cpp context runs one sequence (seq 0) at a time, on one thread; requests take turns in
arrival order. A prompt that shares a prefix with what the context holds evaluates only the rest, and
what the context holds is published as KV events in the project's hashes (token_events.py).
Sampling, penalties, logprobs, stop strings and seeds are the native engine's (its sampler and
detokenizer over llama.cpp's logits and vocabulary), so a seeded request samples alike in every role;
structured output too (the sampler's grammar bitmask, compiled against the GGUF's own vocabulary).

Disaggregation moves sequence state: a PREFILL engine evaluates the prompt, samples the first token,
exports seq 0 (llama_state_seq_get_data) into a BlobPool of one block per prompt token (a block
holds a one-token state, and an n-token state is never larger than n of them) and hands the blocks
to its worker as HeldKV, which the KV transfer agent holds for a pull or pushes; a DECODE engine
reserves as many blocks, lets its kv_loader fill them, imports the state (llama_state_seq_set_data)
and continues from the first token. DYNAMO_PD_TEST_DROP_SEQ_STATE=1 (tests only: the control that
shows the state matters) makes a DECODE engine continue from the first token alone, without it.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from llama_cpp import Llama, llama_cpp as C
import numpy as np
import torch

from dynamo_pd.engines.base import Engine, EngineConfig, EngineRole, KVLoader
from dynamo_pd.engines.native.detokenizer import IncrementalDetokenizer
from dynamo_pd.engines.native.grammar import Grammars
from dynamo_pd.engines.native.sampler import sample, skip_draw
from dynamo_pd.engines.native.sequence import Sequence
from dynamo_pd.engines.token_events import TokenEvents
from dynamo_pd.guided import KINDS
from dynamo_pd.handoff_kinds import HeldKV
from dynamo_pd.model_store import DEFAULT_MODEL, ModelNotFoundError, default_gguf_path
from dynamo_pd.protocol import EngineOutput, EngineRequest, InvalidRequestError, PromptTooLongError
from dynamo_pd.runtime import RequestContext
from kv_transfer.memory import BlobPool
from router.events import KVEvent
from router.load import StepCosts

if TYPE_CHECKING:
    import xgrammar

_SEQ = 0  # the one llama.cpp sequence every request runs in
_DROP_STATE_ENV = "DYNAMO_PD_TEST_DROP_SEQ_STATE"


@dataclass(frozen=True)
class LlamaCppStats:
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_active_prefill_tokens: int = 0
    costs: StepCosts = StepCosts()  # not measured: the router uses its priors


def gguf_path(model: str | None) -> Path:
    if model is None or model == DEFAULT_MODEL:
        return default_gguf_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    raise ModelNotFoundError(f"the llamacpp engine serves GGUF files: --model path/to/model.gguf, got {model!r}")


class _Vocab:
    """llama.cpp's detokenizer as the native IncrementalDetokenizer asks for it."""

    def __init__(self, llm: Llama):
        self._llm = llm

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._llm.detokenize(ids, special=not skip_special_tokens).decode("utf-8", errors="replace")


class LlamaCppEngine(Engine):
    kv_handoffs = ("pull", "push")  # of sequence states staged in `kv_cache` (a BlobPool)
    guided_kinds = KINDS  # the native sampler's grammars (native/grammar.py) over the GGUF's vocabulary
    logit_bias = True  # the native sampler's too

    def __init__(self, config: EngineConfig, kv_loader: KVLoader | None = None):
        if config.role is EngineRole.DECODE and kv_loader is None:
            raise ValueError("a DECODE LlamaCppEngine needs a kv_loader to import sequence state")
        self.config, self.role, self.kv_loader = config, config.role, kv_loader
        self.stats = LlamaCppStats()
        self._llm: Llama | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="llamacpp")  # every llama.cpp call
        self._turn = asyncio.Lock()  # one request on the context at a time, in arrival order
        self._waiting = 0
        self._held: dict[str, tuple[list[int], float]] = {}  # PREFILL: request id -> staged blocks, lease end
        self._events = TokenEvents(config.block_size)
        self._generator = torch.Generator().manual_seed(config.seed)
        self.pool: BlobPool | None = None

    # ---- life

    async def start(self) -> None:
        await self._call(self._load)
        self._update_stats()

    def _load(self) -> None:
        cfg = self.config
        # --num-threads, else the share of the cores the launcher gave this worker (OMP_NUM_THREADS); llama-cpp-
        # python's own default is half the host's cores for decode and all of them for prompts, whatever runs beside
        share = os.environ.get("OMP_NUM_THREADS", "")
        threads = int(cfg.extra.get("num_threads") or 0) or (int(share) if share.isdigit() else 0) or None
        llm = Llama(
            model_path=str(gguf_path(cfg.model)),
            n_ctx=cfg.max_model_len or 0,
            n_batch=cfg.max_num_batched_tokens,
            n_threads=threads,
            n_threads_batch=threads,
            seed=cfg.seed,
            verbose=False,
        )
        trained = C.llama_model_n_ctx_train(llm.model)
        if cfg.max_model_len and cfg.max_model_len > trained:
            raise ValueError(f"max_model_len {cfg.max_model_len} exceeds the model's context ({trained} tokens)")
        self._llm = llm
        vocab = C.llama_model_get_vocab(llm.model)
        self._eog = frozenset(t for t in range(llm.n_vocab()) if C.llama_vocab_is_eog(vocab, t))
        self._vocab = _Vocab(llm)
        self.grammars = Grammars(_tokenizer_info(llm, self._eog))
        self.grammars.compiler()  # its Grammars' docstring: why before serving
        if self.role is EngineRole.AGGREGATED:
            self.pool = BlobPool(1, 2)  # nothing to stage; the worker's agent still wants a cache to wrap
            return
        llm.eval([0])  # a one-token state sizes a block (an n-token state is at most n of them)
        block_bytes = C.llama_state_seq_get_size(llm.ctx, _SEQ) + BlobPool.HEADER
        self._forget()
        block_bytes += block_bytes % 2
        self.pool = BlobPool(max(1, int(cfg.kv_cache_memory_gb * 2**30) // block_bytes), block_bytes)

    async def stop(self) -> None:
        if self._llm is not None:
            await self._call(self._llm.close)
            self._llm = None
        self._thread.shutdown(wait=False)

    @property
    def max_model_len(self) -> int:
        return self._llm.n_ctx()

    @property
    def kv_cache(self) -> torch.Tensor:
        """The staging pool as a [1, 2, blocks, 1, 1, block_bytes / 2] uint8 cache (kv_transfer.BlobPool)."""
        return self.pool.tensor

    def drain_kv_events(self) -> list[KVEvent]:
        return self._events.drain()

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    # ---- requests

    def check_request(self, request: EngineRequest) -> None:
        request.check_fits(self.max_model_len, self._llm.n_vocab())
        prompt = request.prompt_token_ids
        if self.role is not EngineRole.AGGREGATED and len(prompt) > self.pool.num_blocks:
            raise PromptTooLongError(f"prompt ({len(prompt)} tokens) does not fit the sequence-state pool "
                                     f"({self.pool.num_blocks} tokens; --kv-cache-memory-gb)", "prompt")

    async def generate(self, request: EngineRequest, context: RequestContext) -> AsyncIterator[EngineOutput]:
        self.check_request(request)
        seed, guided = request.sampling.seed, request.sampling.guided
        seq = Sequence(request=request, block_size=self.config.block_size,
                       detokenizer=IncrementalDetokenizer(self._vocab, request.prompt_token_ids, request.stop.stop),
                       generator=None if seed is None else torch.Generator().manual_seed(seed))
        if guided is not None:  # compiled before its turn, off the llama.cpp thread
            compiled = await asyncio.to_thread(self.grammars.compile, guided)
            seq.grammar = self.grammars.matcher(guided, compiled)
        loaded: tuple[list[int], list[int] | None] | None = None
        try:
            if self.role is EngineRole.DECODE and request.handoff is not None:
                loaded = await self._load_state(request)  # before its turn: the transfer needs no context
            self._waiting += 1
            self._update_stats()
            try:
                await self._turn.acquire()
            finally:
                self._waiting -= 1
            try:
                out = await self._call(self._first, seq, loaded)
                while True:
                    yield out
                    if out.finish_reason is not None:
                        return
                    if context.cancelled:
                        yield EngineOutput(request_id=request.request_id, token_ids=[],
                                           text=seq.detokenizer.delta(finished=True), finish_reason="abort")
                        return
                    out = await self._call(self._next, seq)
            finally:
                self._events.hold("seq", self._llm.input_ids[: self._llm.n_tokens].tolist())
                self._turn.release()
                self._update_stats()
        except Exception as exc:  # noqa: BLE001 - a failed load or llama.cpp call ends this request only
            if isinstance(exc, InvalidRequestError):
                raise
            yield EngineOutput(request_id=request.request_id, token_ids=[], finish_reason="error",
                               error=f"llama.cpp request {request.request_id!r} failed: {exc!r}")
        finally:
            if loaded is not None:
                self.pool.free(loaded[0])

    async def _load_state(self, request: EngineRequest) -> tuple[list[int], list[int] | None]:
        handoff = request.handoff
        if handoff.num_tokens != len(request.prompt_token_ids):
            raise InvalidRequestError(f"the hand-off holds {handoff.num_tokens} tokens of state, the prompt has "
                                      f"{len(request.prompt_token_ids)}", "handoff")
        blocks = self.pool.allocate(handoff.num_tokens)
        try:
            async with asyncio.timeout(self.config.handoff.load_timeout_s(handoff)):
                first = await self.kv_loader(handoff, blocks, 0)
        except BaseException:
            self.pool.free(blocks)
            raise
        return blocks, first

    # ---- on the llama.cpp thread

    def _first(self, seq: Sequence, loaded: tuple[list[int], list[int] | None] | None) -> EngineOutput:
        """Evaluate the prompt (or import its state) and emit the first token."""
        llm, prompt = self._llm, seq.request.prompt_token_ids
        if loaded is not None:
            self._import(self.pool.read(loaded[0]), prompt)
            token = seq.request.first_token_id if loaded[1] is None else loaded[1][0]
            if token is None:
                raise ValueError("the hand-off gave no first token")
            skip_draw(seq)
            return self._append(seq, token, None, echo=True)
        held = llm.input_ids[: llm.n_tokens]
        same = np.flatnonzero(held[: len(prompt)] != np.asarray(prompt[: len(held)], dtype=held.dtype))
        reused = min(int(same[0]) if len(same) else min(len(held), len(prompt)), len(prompt) - 1)
        seq.num_cached_tokens = reused
        llm.n_tokens = reused  # eval drops the cells past it
        llm.eval(prompt[reused:])
        token, logprob = self._sample(seq)
        if seq.request.first_token_id is not None:  # prefilled here after a failed hand-off: echo its token
            return self._append(seq, seq.request.first_token_id, None, echo=True)
        out = self._append(seq, token, logprob)
        if out.finish_reason == "prefill_done":
            out.handoff = self._stage(seq.request_id, len(prompt))
        return out

    def _next(self, seq: Sequence) -> EngineOutput:
        self._llm.eval([seq.token_ids[-1]])
        return self._append(seq, *self._sample(seq))

    def _sample(self, seq: Sequence):
        logits = np.ctypeslib.as_array(C.llama_get_logits_ith(self._llm.ctx, -1), shape=(self._llm.n_vocab(),))
        token_ids, logprobs = sample(torch.from_numpy(logits.copy())[None], [seq], self._generator)
        return token_ids[0], logprobs[0]

    def _append(self, seq: Sequence, token: int, logprob, echo: bool = False) -> EngineOutput:
        out = seq.append(token, logprob, eos_token_ids=self._eog, max_model_len=self.max_model_len,
                         prefill=self.role is EngineRole.PREFILL, echo=echo)
        if out.finish_reason is not None:
            out.usage = seq.usage()
        return out

    def _stage(self, request_id: str, num_tokens: int) -> HeldKV:
        """PREFILL: copy seq 0's state into pool blocks, held until release_handoff or the lease ends."""
        size = C.llama_state_seq_get_size(self._llm.ctx, _SEQ)
        buffer = (ctypes.c_uint8 * size)()
        if C.llama_state_seq_get_data(self._llm.ctx, buffer, size, _SEQ) != size:
            raise RuntimeError("llama_state_seq_get_data wrote less than llama_state_seq_get_size said")
        self._expire_held()
        blocks = self.pool.allocate(num_tokens)
        if self.pool.blocks_for(size) > num_tokens:
            self.pool.free(blocks)
            raise RuntimeError(f"a {num_tokens}-token sequence state of {size} bytes outgrew its blocks")
        self.pool.write(blocks, memoryview(buffer))
        self._held[request_id] = (blocks, time.monotonic() + self.config.handoff.engine_lease_s)
        return HeldKV(request_id=request_id, block_ids=blocks, num_tokens=num_tokens)

    def _import(self, state: bytes, prompt: list[int]) -> None:
        llm = self._llm
        self._forget()
        if os.environ.get(_DROP_STATE_ENV) == "1":  # tests only: continue without the prefill's state
            return
        src = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        if C.llama_state_seq_set_data(llm.ctx, src, len(state), _SEQ) == 0:
            raise RuntimeError(f"llama_state_seq_set_data refused a {len(state)}-byte sequence state")
        held = C.llama_memory_seq_pos_max(C.llama_get_memory(llm.ctx), _SEQ) + 1
        if held != len(prompt):
            self._forget()
            raise RuntimeError(f"the imported sequence state holds {held} tokens, the prompt has {len(prompt)}")
        llm.input_ids[: len(prompt)] = prompt
        llm.n_tokens = len(prompt)

    def _forget(self) -> None:
        C.llama_memory_seq_rm(C.llama_get_memory(self._llm.ctx), _SEQ, -1, -1)
        self._llm.n_tokens = 0

    # ---- hand-off and load

    async def release_handoff(self, request_id: str) -> None:
        held = self._held.pop(request_id, None)  # None: the lease backstop freed it already
        if held is not None:
            self.pool.free(held[0])
        self._update_stats()

    def _expire_held(self) -> None:
        """The backstop for a release that never came (the worker's agent ends every hold before this)."""
        now = time.monotonic()
        for rid, (blocks, end) in list(self._held.items()):  # a copy: release_handoff pops on the event loop
            if end <= now and self._held.pop(rid, None) is not None:
                self.pool.free(blocks)

    def _update_stats(self) -> None:
        bs = self.config.block_size
        total = self.max_model_len // bs
        busy = self._turn.locked()
        self.stats = LlamaCppStats(num_running=int(busy), num_waiting=self._waiting,
                                   num_free_blocks=total if not busy else total - self._llm.n_tokens // bs,
                                   num_total_blocks=total)


def _tokenizer_info(llm: Llama, eog: frozenset[int]) -> Callable[[], xgrammar.TokenizerInfo]:
    """The GGUF's vocabulary as xgrammar reads a tokenizer: each token's text in the vocabulary's own
    encoding, control tokens empty (so no grammar allows them), the end-of-generation ids as its stops. The
    texts are read here, on the loading thread: the tables are built later on a thread of their own, which
    must not touch the model (an engine stopped meanwhile has freed it; reading it then aborted the process)."""
    vocab, n = C.llama_model_get_vocab(llm.model), llm.n_vocab()
    kind = C.llama_vocab_type(vocab)
    texts = [b"" if C.llama_vocab_is_control(vocab, t) else C.llama_vocab_get_text(vocab, t) for t in range(n)]

    def build() -> xgrammar.TokenizerInfo:
        import xgrammar as xgr

        encoding = {C.LLAMA_VOCAB_TYPE_BPE: xgr.VocabType.BYTE_LEVEL,
                    C.LLAMA_VOCAB_TYPE_SPM: xgr.VocabType.BYTE_FALLBACK}.get(kind, xgr.VocabType.RAW)
        return xgr.TokenizerInfo([t.decode("utf-8", errors="replace") for t in texts], encoding, vocab_size=n,
                                 stop_token_ids=sorted(eog))

    return build
