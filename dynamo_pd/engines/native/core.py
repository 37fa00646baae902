"""The synchronous engine: requests in, one `step()` at a time, EngineOutputs out.

Single-threaded by design: NativeEngine drives it from its step thread, LLM from the caller's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dynamo_pd.engines.base import EngineConfig, EngineRole
from dynamo_pd.engines.native.block_manager import BlockManager
from dynamo_pd.engines.native.config import ModelConfig
from dynamo_pd.engines.native.detokenizer import IncrementalDetokenizer
from dynamo_pd.engines.native.grammar import huggingface_grammars
from dynamo_pd.engines.native.loader import load_weights
from dynamo_pd.engines.native.model import LlamaModel
from dynamo_pd.engines.native.model_runner import ModelRunner, allocate_kv_cache, kv_bytes_per_block
from dynamo_pd.engines.native.sampler import sample, score_prompt, skip_draw
from dynamo_pd.engines.native.scheduler import Scheduler
from dynamo_pd.engines.native.sequence import Sequence, SequenceStatus
from dynamo_pd.engines.native.step_costs import FetchCostMeter, StepCostMeter, StepLoad
from dynamo_pd.engines.native.tiers import KVTiers, Onboarded, TierConfig, TierUse
from dynamo_pd.model_store import load_tokenizer, resolve_model
from dynamo_pd.handoff_kinds import EngineHandoff, HeldKV, PushHandoff
from dynamo_pd.protocol import (
    EngineOutput,
    EngineRequest,
    InvalidRequestError,
    PromptTooLongError,
    TokenLogprob,
    Usage,
)
from router.load import FetchCosts, StepCosts

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Prefixes pinned for peers at once: more would share this worker's link (and slow its own steps) while
# the pulls' predicted times assumed it to themselves.
MAX_PEER_PINS = 4


@dataclass(frozen=True)
class EngineStats:
    """A load snapshot for routers and metrics."""

    num_running: int = 0
    num_waiting: int = 0
    num_loading: int = 0  # DECODE role: waiting for their KV
    num_held: int = 0  # PREFILL role: finished, blocks held for hand-off
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_active_tokens: int = 0  # tokens of running sequences (their KV footprint)
    num_active_prefill_tokens: int = 0  # prompt tokens still to compute
    num_preemptions: int = 0
    handoff_expiries: int = 0
    num_peer_pins: int = 0  # prefixes pinned while peers read them
    costs: StepCosts = StepCosts()  # what its steps cost, measured (step_costs.py)
    fetch: FetchCosts = FetchCosts()  # what fetching KV costs it (tiers, peers), measured (step_costs.py)
    tiers: tuple[TierUse, ...] = ()  # each lower tier's blocks and what it served (tiers.py)
    # time.monotonic() when the requests these counts hold were fixed (the commands run before the step): one
    # that reached the engine later is not in them, which a router must know (router/load.py); None: unknown
    counted_at: float | None = None


class EngineCore:
    def __init__(self, config: EngineConfig):
        if config.dtype not in _DTYPES:
            raise ValueError(f"dtype {config.dtype!r} is not supported; use one of {', '.join(_DTYPES)}")
        self.config = config
        self.role = config.role
        self.model_dir = resolve_model(config.model)
        self.model_config = mc = ModelConfig.from_dir(self.model_dir)
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's context "
                             f"({mc.max_position_embeddings} tokens)")
        if config.extra.get("num_threads"):  # CPU workers sharing a machine: one pool each, no spinning
            torch.set_num_threads(int(config.extra["num_threads"]))
        self.device = torch.device(config.device)
        dtype = _DTYPES[config.dtype]
        self.tokenizer = load_tokenizer(self.model_dir)
        self.eos_token_ids = frozenset(mc.eos_token_ids)
        self.grammars = huggingface_grammars(self.model_dir, mc.vocab_size, self.eos_token_ids)
        model = LlamaModel(mc, load_weights(self.model_dir, mc, self.device, dtype), self.max_model_len, self.device)
        bs = config.block_size
        num_blocks = config.num_kv_blocks or int(config.kv_cache_memory_gb * 2**30) // kv_bytes_per_block(
            model, bs, dtype)
        if num_blocks < 1:
            raise ValueError(f"KV cache of {config.kv_cache_memory_gb} GiB holds no {bs}-token block")
        self.kv_cache = allocate_kv_cache(model, num_blocks, bs, dtype, self.device)
        block_bytes = kv_bytes_per_block(model, bs, dtype)
        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching,
                                          self._tiers(config, block_bytes))
        self.fetch_costs = FetchCostMeter(block_bytes)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(model, self.kv_cache, bs, self.device)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.seqs: dict[str, Sequence] = {}  # waiting, loading or running
        self.held: dict[str, tuple[Sequence, float]] = {}  # PREFILL role: request id -> (seq, lease end)
        self.handoff_expiries = 0
        self.stalled = False  # the last step found work but could schedule none of it
        self.step_costs = StepCostMeter()
        self.pins: dict[str, list[int]] = {}  # prefixes pinned for peers: pin id -> blocks

    def _tiers(self, config: EngineConfig, block_bytes: int) -> KVTiers | None:
        """The tiers below the pool, sized in `block_bytes` blocks; None without any."""
        tiers = TierConfig.of(config.kv_host_gb, config.kv_disk_gb, config.kv_disk_dir, block_bytes)
        return KVTiers(self.kv_cache, tiers, config.block_size) if tiers.enabled else None

    def close(self) -> None:
        """The engine stops: the disk tier's writer ends and its files go."""
        if self.block_manager.tiers is not None:
            self.block_manager.tiers.close()

    # ---- requests in

    def check_request(self, request: EngineRequest) -> None:
        """Raise InvalidRequestError / PromptTooLongError naming what is wrong; touches no state."""
        vocab = self.model_config.vocab_size
        request.check_fits(self.max_model_len, vocab)
        prompt = request.prompt_token_ids
        total = len(prompt) + request.stop.max_tokens
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if total > capacity:
            raise PromptTooLongError(
                f"prompt plus max_tokens is {total} tokens, more than the whole KV cache ({capacity} tokens)", "prompt")
        resumed = request.resume_token_ids
        if resumed:
            if len(resumed) >= request.stop.max_tokens:
                raise InvalidRequestError(f"{len(resumed)} resumed tokens leave none of max_tokens "
                                          f"{request.stop.max_tokens}", "resume_token_ids")
            if any(not 0 <= t < vocab for t in resumed):
                raise InvalidRequestError("a resumed token id is outside the vocabulary", "resume_token_ids")
            if request.handoff is not None or request.first_token_id is not None:
                raise InvalidRequestError("a resumed request is prefilled where it resumes, without a hand-off",
                                          "resume_token_ids")
            if request.sampling.n > 1:
                raise InvalidRequestError("a request with n > 1 choices does not resume", "n")
        if request.fork_token_ids and len(request.fork_token_ids) != request.sampling.n - 1:
            raise InvalidRequestError(f"fork_token_ids holds {len(request.fork_token_ids)} tokens for "
                                      f"{request.sampling.n} choices", "fork_token_ids")
        handoff = request.handoff
        if self.role is EngineRole.DECODE and handoff is not None:  # without one, decode prefills locally
            if isinstance(handoff, EngineHandoff):
                raise InvalidRequestError("this engine's KV is moved by its worker, not by an engine connector",
                                          "handoff")
            if request.first_token_id is None and not isinstance(handoff, PushHandoff):
                raise InvalidRequestError("a pull hand-off needs the first_token_id the prefill sampled",
                                          "first_token_id")
            if handoff.num_tokens != len(prompt):
                raise InvalidRequestError(
                    f"handoff holds {handoff.num_tokens} tokens of KV but the prompt has {len(prompt)}", "handoff")

    def add_request(self, request: EngineRequest, grammar: CompiledGrammar | None = None,
                    peer_loads: bool = False) -> None:
        """Queue `request`. A request under a grammar gets its matcher here, from `grammar` when the caller
        compiled it off this thread (CoreDriver), else compiled now. `peer_loads`: the caller reads a prefix
        a peer holds (request.kv_prefix) before the rest is computed; else kv_prefix is ignored."""
        self.check_request(request)
        rid = request.request_id
        if rid in self.seqs or rid in self.held:
            raise InvalidRequestError(f"request id {rid!r} is already in use", "request_id")
        seq = self._choice(request, 0, grammar)
        seq.forks = [self._choice(request, i, grammar) for i in range(1, request.sampling.n)]
        seq.needs_load = self.role is EngineRole.DECODE and request.handoff is not None
        seq.peer_load = (peer_loads and request.kv_prefix is not None and request.handoff is None
                         and not seq.scores_prompt)
        for token in request.resume_token_ids:  # sampled before a migration: as if sampled here
            if seq.grammar is not None and not seq.grammar.accept_token(token):
                raise InvalidRequestError(f"resumed token {token} does not follow the request's grammar",
                                          "resume_token_ids")
            seq.token_ids.append(token)
            seq.detokenizer.add(token)
            skip_draw(seq)
        if request.resume_token_ids:
            seq.detokenizer.delta(finished=False)  # the text those tokens streamed, by the same holdback
        self.seqs[rid] = seq
        self.scheduler.add(seq)

    def _choice(self, request: EngineRequest, index: int, grammar: CompiledGrammar | None) -> Sequence:
        """Choice `index` of `request`: its own detokenizer, grammar matcher and generator (seed + index, as
        vLLM seeds its n > 1 samples). The first is queued; the others wait to fork from it (FORK)."""
        seed = request.sampling.seed
        seq = Sequence(
            request=request,
            block_size=self.block_manager.block_size,
            detokenizer=IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, request.stop.stop),
            generator=None if seed is None else torch.Generator().manual_seed(seed + index),
            status=SequenceStatus.FORK if index else SequenceStatus.WAITING,
            index=index,
        )
        if request.sampling.guided is not None:
            seq.grammar = self.grammars.matcher(request.sampling.guided, grammar)
        return seq

    # ---- the step

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[EngineOutput]:
        started = time.perf_counter()
        batch = self.scheduler.schedule()
        onboard_s = self._onboarded()
        # Work that cannot run yet (blocks held by hand-offs or loads) waits for a command, not a spin.
        self.stalled = not batch
        if not batch:
            return []
        load = StepLoad.of(batch)
        seqs, logits, prompt_scores = self.runner.run(batch)
        for seq, n in batch:
            seq.num_computed_tokens += n
            self.block_manager.commit(seq)
        for seq, rows in prompt_scores:
            score_prompt(rows, seq)
        seqs, logits = self._fork(seqs, logits)
        token_ids, logprobs = sample(logits, seqs, self.generator)
        outputs = []
        for seq, token, logprob in zip(seqs, token_ids, logprobs):
            given = seq.given_token
            if given is not None and not seq.output_token_ids:
                # Prefilled here after a failed hand-off: the prefill side sampled (and streamed) the
                # first token; the draw just made for it leaves the seeded generator where it would be.
                outputs.append(self._append(seq, given, None, echo=True))
            else:
                outputs.append(self._append(seq, token, logprob))
        self.step_costs.observe(load, time.perf_counter() - started - onboard_s)  # the model's share of it
        return outputs

    def _fork(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[list[Sequence], torch.Tensor]:
        """The sequences to sample, each prompt that just ended followed by its other choices (n > 1), which
        sample from its logits row."""
        rows, joined = [], []
        for row, seq in enumerate(seqs):
            choices = self._with_forks(seq)
            rows += [row] * len(choices)
            joined += choices
        if len(joined) == len(seqs):
            return seqs, logits
        return joined, logits[rows]

    def _with_forks(self, seq: Sequence) -> list[Sequence]:
        """`seq` and the choices forking from it now (its prompt's end), joined to it: each takes its
        references on the shared blocks before any choice can end and free them."""
        return [seq, *(fork for fork in seq.forks if fork.status is SequenceStatus.FORK and self._join(seq, fork))]

    def _join(self, first: Sequence, fork: Sequence) -> bool:
        """`fork` runs on from `first`'s prompt KV, its full blocks shared and its last partial one copied (a
        PREFILL engine's choices only sample their first token: they need no blocks). False: no block for the
        copy, so the fork waits to compute the prompt's last block itself."""
        if self.role is not EngineRole.PREFILL:
            copies = self.block_manager.fork(first, fork)
            if copies is None:
                self.scheduler.add(fork)
                return False
            for src, dst in copies:
                self.kv_cache[:, :, dst].copy_(self.kv_cache[:, :, src])
        fork.num_computed_tokens = first.num_computed_tokens
        fork.num_cached_tokens = first.num_cached_tokens
        self.scheduler.join(fork)
        return True

    def _onboarded(self) -> float:
        """Seconds this step's admissions spent copying blocks back from the tiers, each copy measured."""
        tiers = self.block_manager.tiers
        if tiers is None:
            return 0.0
        total = 0.0
        for run in tiers.take_onboarded():
            seconds, nbytes = self._onboard_seconds(run), run.blocks * self.fetch_costs.block_bytes
            self.fetch_costs.tiers[run.tier].observe(nbytes, seconds)
            use = tiers.use[run.tier]
            use.onboarded_bytes += nbytes
            use.onboarded_seconds += seconds
            total += seconds
        return total

    def _onboard_seconds(self, run: Onboarded) -> float:
        """How long a copy-back took (the mocker's: its profile's time)."""
        return run.seconds

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob | None, echo: bool = False) -> EngineOutput:
        out = seq.append(token, logprob, eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len,
                         prefill=self.role is EngineRole.PREFILL, echo=echo)
        out.index = seq.index
        scores = seq.prompt_logprobs
        if scores is not None and not seq.index and len(seq.output_token_ids) == 1 and \
                len(scores) == seq.num_prompt_tokens:  # computed here: with the request's first output
            out.prompt_logprobs = scores
        if out.finish_reason is not None:
            self._finish(seq, out)
        return out

    def _finish(self, seq: Sequence, out: EngineOutput) -> None:
        """A choice ends (HELD: its decode goes on elsewhere). The request ends with its last choice, whose
        output carries the usage of all; a PREFILL request's blocks (its first choice's) wait for that end, to
        be held for the decode side when any choice goes on there."""
        self.scheduler.remove(seq)
        if not seq.request.probe:  # a canary's one token says nothing of the requests' lengths
            self.step_costs.finished(len(seq.output_token_ids))
        seq.status = SequenceStatus.HELD if out.finish_reason == "prefill_done" else SequenceStatus.FINISHED
        if self.role is not EngineRole.PREFILL:
            self.block_manager.release(seq)  # a fork keeps its own references on the blocks they share
        first = self.seqs[seq.request_id]
        choices = [first, *first.forks]
        out.choices_left = sum(c.status not in (SequenceStatus.FINISHED, SequenceStatus.HELD) for c in choices)
        if out.choices_left:
            return
        del self.seqs[seq.request_id]
        out.usage = Usage(prompt_tokens=first.num_prompt_tokens, cached_tokens=first.num_cached_tokens or 0,
                          completion_tokens=sum(len(c.output_token_ids) for c in choices))
        if self.role is not EngineRole.PREFILL:
            return
        if any(c.status is SequenceStatus.HELD for c in choices):
            self.held[seq.request_id] = (first, time.monotonic() + self.config.handoff.engine_lease_s)
            out.handoff = HeldKV(request_id=seq.request_id, block_ids=list(first.block_table),
                                 num_tokens=first.num_prompt_tokens)
        else:
            self.block_manager.release(first)

    def end_request(self, request_id: str, reason: str, error: str | None = None) -> EngineOutput | None:
        """Abort (reason "abort") or fail (reason "error") an active request, every choice of it, freeing
        its blocks; its last output."""
        first, out = self.seqs.get(request_id), None
        if first is None:
            return None
        for seq in [first, *first.forks]:
            if seq.status not in (SequenceStatus.FINISHED, SequenceStatus.HELD):
                out = EngineOutput(request_id=request_id, token_ids=[], text=seq.detokenizer.delta(finished=True),
                                   finish_reason=reason, error=error, index=seq.index)
                self._finish(seq, out)
        return out

    def fail_all(self, error: str) -> list[EngineOutput]:
        return [self.end_request(rid, "error", error) for rid in list(self.seqs)]

    # ---- disaggregation hooks

    def take_new_loads(self) -> list[Sequence]:
        """DECODE role: sequences whose blocks were just reserved and now wait for their KV."""
        loads, self.scheduler.new_loads = self.scheduler.new_loads, []
        return loads

    def finish_load(self, request_id: str, first_token_ids: list[int] | None = None) -> list[EngineOutput]:
        """The kv_loader filled the blocks: decode starts from the first tokens the prefill side sampled, one
        per choice (those that came with the KV, else the request's), the other choices forked here (n > 1),
        each echoing its token with the text it did not stream."""
        first = self.seqs.get(request_id)
        if first is None or first.status is not SequenceStatus.LOADING:
            return []
        choices = [first, *first.forks]
        if first_token_ids is not None and len(first_token_ids) == len(choices):
            for choice, token in zip(choices, first_token_ids):
                choice.given_token = token
        vocab = self.model_config.vocab_size
        if (first_token_ids is not None and len(first_token_ids) != len(choices)) or \
                any(c.given_token is None or not 0 <= c.given_token < vocab for c in choices):
            return [self.end_request(request_id, "error", f"hand-off of {request_id!r} gave no valid first token "
                                                          f"for each of its {len(choices)} choices")]
        self.scheduler.loaded(first)
        echoing = self._with_forks(first)
        outputs = []
        for choice in echoing:
            skip_draw(choice)
            outputs.append(self._append(choice, choice.given_token, None, echo=True))
        return outputs

    def finish_prefix_load(self, request_id: str, num_blocks: int) -> None:
        """The peer's read of a request's prefix ended: its first `num_blocks` blocks are in place (as many
        as it had before, when the read failed); the rest is computed."""
        seq = self.seqs.get(request_id)
        if seq is not None and seq.status is SequenceStatus.LOADING and seq.peer_load:
            self.scheduler.loaded_prefix(seq, num_blocks)

    def pin_prefix(self, pin_id: str, hashes: list[int]) -> list[int] | None:
        """A peer reads the cached blocks holding the longest prefix of `hashes`: they stay until unpin_prefix
        ([] when none are cached). None: busy (MAX_PEER_PINS reads at once, or work waits for blocks)."""
        if len(self.pins) >= MAX_PEER_PINS or self.stalled or pin_id in self.pins:
            return None
        blocks = self.block_manager.pin(hashes)
        if blocks:
            self.pins[pin_id] = blocks
        return blocks

    def unpin_prefix(self, pin_id: str) -> None:
        blocks = self.pins.pop(pin_id, None)
        if blocks:
            self.block_manager.unpin(blocks)

    def release_handoff(self, request_id: str) -> bool:
        held = self.held.pop(request_id, None)
        if held is not None:
            self.block_manager.release(held[0])
        return held is not None

    def expire_handoffs(self) -> None:
        now = time.monotonic()
        for rid in [rid for rid, (_, deadline) in self.held.items() if deadline <= now]:
            self.release_handoff(rid)
            self.handoff_expiries += 1

    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()

    def stats(self) -> EngineStats:
        sched, bm = self.scheduler, self.block_manager
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_loading=len(sched.loading),
            num_held=len(self.held),
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks,
            num_active_tokens=sum(len(seq.token_ids) for seq in sched.running),
            num_active_prefill_tokens=sched.num_active_prefill_tokens,
            num_preemptions=sched.num_preemptions,
            handoff_expiries=self.handoff_expiries,
            num_peer_pins=len(self.pins),
            costs=self.step_costs.costs(),
            fetch=self.fetch_costs.costs(),
            tiers=bm.tiers.usage() if bm.tiers is not None else (),
        )
