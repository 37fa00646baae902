"""MockerCore: the native engine core with its forward pass replaced by a performance profile.

Everything but the model is the native engine's (engines/native/core.py): admission, chunked prefill,
max_num_seqs and the token budget, prefix caching with LRU eviction and its KV events, preemption,
PREFILL holds and DECODE loads, stop conditions and detokenization. `step()` schedules a batch as
the native engine does and sets `step_s`, how long the profiled model takes for it (divided by the
speed-up). Instead of K and V it writes each computed token's id into a tiny KV cache in the native
layout (1 layer, 1 head, 4 floats): not the model's KV, but real blocks for kv_transfer to move and
for tests to check. Sampled tokens are pseudo-random and deterministic: a hash of the position and
of the prompt (greedy), the prompt and seed (seeded), or the prompt and request id (else), and of the choice
(n > 1). Under a grammar (structured output) the pick is among the tokens it allows, a stop token as soon as it
allows one (the output ends as early as the grammar lets it). A logit bias acts on stand-in logits (not under a
grammar, whose rule picks): the hashed pick's is _PICK_LOGIT, every other token's 0; the highest biased one
wins. Prompt logprobs (and every logprob) are hashes too, of the prompt and the position.
"""

from __future__ import annotations

import functools
import struct
import threading
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import xxhash
from transformers import AutoTokenizer

from dynamo_pd.engines.base import EngineConfig
from dynamo_pd.engines.mocker.profile import Profile
from dynamo_pd.engines.native.block_manager import BlockManager
from dynamo_pd.engines.native.config import ModelConfig
from dynamo_pd.engines.native.core import EngineCore
from dynamo_pd.engines.native.grammar import allowed_tokens, huggingface_grammars
from dynamo_pd.engines.native.scheduler import Scheduler
from dynamo_pd.engines.native.sequence import Sequence
from dynamo_pd.engines.native.step_costs import FetchCostMeter, StepCostMeter, StepLoad
from dynamo_pd.engines.native.tiers import Onboarded
from dynamo_pd.model_store import resolve_model
from dynamo_pd.protocol import EngineOutput, TokenLogprob
from router.hashing import token_bytes

if TYPE_CHECKING:
    from xgrammar import GrammarMatcher

KV_HEAD_DIM = 4  # the tiny stand-in KV: [1 layer, 2, blocks, block_size, 1 head, 4] float32
_PICK_LOGIT = 10.0  # the hashed pick's stand-in logit (logit_bias): a bias above it picks another token
_PAIR = struct.Struct("<QQ")


class TextTable:
    """Stands in for the tokenizer: every token's text, decoded once; ids decode to the join of theirs
    (special tokens to ""). Mocker tokens are `plain` ids (printable ASCII, not added tokens), whose
    joined text is what the real tokenizer decodes."""

    def __init__(self, tokenizer) -> None:
        self.texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=True)
        added = tokenizer.added_tokens_decoder  # special or not, never plain text
        self.plain = [i for i, text in enumerate(self.texts)
                      if text and text.isascii() and text.isprintable() and i not in added]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:  # the tokenizer's signature
        return "".join(self.texts[i] for i in ids)


_tables_lock = threading.Lock()  # many workers of one process start at once: build each table once


@functools.cache
def _text_table(model_dir: Path) -> TextTable:
    return TextTable(AutoTokenizer.from_pretrained(model_dir))


def text_table(model_dir: Path) -> TextTable:
    with _tables_lock:
        return _text_table(model_dir)


class MockerCore(EngineCore):
    def __init__(self, config: EngineConfig, profile: Profile, speedup: float = 1.0):
        # EngineCore's state without its model (its __init__ loads weights): same fields, same meaning.
        self.config = config
        self.role = config.role
        self.profile = profile
        self.speedup = speedup
        self.model_dir = resolve_model(config.model)
        self.model_config = mc = ModelConfig.from_dir(self.model_dir)  # the served model's vocabulary
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's context "
                             f"({mc.max_position_embeddings} tokens)")
        self.tokenizer = text_table(self.model_dir)
        self.eos_token_ids = frozenset(mc.eos_token_ids)
        self.grammars = huggingface_grammars(self.model_dir, mc.vocab_size, self.eos_token_ids)
        self._plain_mask = torch.zeros(mc.vocab_size, dtype=torch.bool)  # plain ids: picks under a grammar
        self._plain_mask[[t for t in self.tokenizer.plain if t < mc.vocab_size]] = True
        bs = config.block_size
        # --kv-cache-memory-gb is the simulated GPU's KV memory, in the profiled model's KV bytes
        kv_bytes = int(config.kv_cache_memory_gb * 2**30)
        num_blocks = config.num_kv_blocks or kv_bytes // (profile.kv_bytes_per_token * bs)
        if num_blocks < 1:
            raise ValueError(f"KV cache of {config.kv_cache_memory_gb} GiB holds no {bs}-token block")
        self.kv_cache = torch.zeros((1, 2, num_blocks, bs, 1, KV_HEAD_DIM), dtype=torch.float32)
        # written every step: numpy's indexing costs a few us a call where torch's costs tens
        self._kv_slots = self.kv_cache.view(2, num_blocks * bs, KV_HEAD_DIM).numpy()
        # the tiers hold the stand-in KV, sized (and timed, _onboard_seconds) in the profiled model's bytes
        block_bytes = profile.kv_bytes_per_token * bs
        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching,
                                          self._tiers(config, block_bytes))
        self.fetch_costs = FetchCostMeter(block_bytes)
        # the profiled links' rates until moves measure them: the router prices an unmeasured pull at
        # FETCH_PRIOR (this host's ZMQ, 40x slower than the profiled NIC), so it would never plan the first one
        self.fetch_costs.pull.observe(block_bytes, profile.transfer_s(bs) / speedup)
        for tier, meter in self.fetch_costs.tiers.items():
            meter.observe(block_bytes, profile.onboard_s(tier, bs) / speedup)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.seqs: dict[str, Sequence] = {}
        self.held: dict[str, tuple[Sequence, float]] = {}
        self.handoff_expiries = 0
        self.stalled = False
        self.step_costs = StepCostMeter()
        self.pins: dict[str, list[int]] = {}
        self.step_s = 0.0  # simulated duration of the last step
        self.step_load = StepLoad(0, 0)  # and what it computed
        self.onboard_s = 0.0  # the part of step_s copying blocks back from the tiers
        self._keys: weakref.WeakKeyDictionary[Sequence, int] = weakref.WeakKeyDictionary()

    def step(self) -> list[EngineOutput]:
        self.step_s = 0.0  # stays 0 without a batch, or if the step fails
        batch = self.scheduler.schedule()
        self.stalled = not batch
        if not batch:
            return []
        self.onboard_s = self._onboarded()
        step_ms = self.profile.step_ms([(n, seq.num_computed_tokens) for seq, n in batch])
        self.step_load = StepLoad.of(batch)  # learnt from once the step has taken its time (step_taken)
        self.step_s = step_ms / 1e3 / self.speedup + self.onboard_s  # the copies back from the tiers come first
        self._write_kv(batch)
        outputs = []
        for seq, n in batch:
            seq.num_computed_tokens += n
            self.block_manager.commit(seq)
        for seq, _ in batch:
            if seq.scores_prompt:
                self._score_prompt(seq)
            if seq.num_computed_tokens < len(seq.token_ids):
                continue  # a prefill chunk short of the prompt's end samples nothing
            for choice in self._with_forks(seq):
                given = choice.given_token
                if given is not None and not choice.output_token_ids:  # prefilled here after a failed hand-off
                    outputs.append(self._append(choice, given, None, echo=True))
                else:
                    outputs.append(self._append(choice, *self._sample(choice)))
        return outputs

    def step_taken(self, seconds: float) -> None:
        """The last step took `seconds` as its requests saw it (the profile's time and this process's own
        work on it, as the native engine measures its steps): what step_costs learns from, for the router
        and the planner."""
        self.step_costs.observe(self.step_load, seconds - self.onboard_s)

    def _score_prompt(self, seq: Sequence) -> None:
        """Stand-in logprobs of the prompt tokens computed so far (position p's logits score token p + 1)."""
        key, plain, k = self._prompt_key(seq), self.tokenizer.plain, seq.request.sampling.prompt_logprobs
        while len(seq.prompt_logprobs) < min(seq.num_computed_tokens + 1, seq.num_prompt_tokens):
            position = len(seq.prompt_logprobs)
            h = xxhash.xxh3_64_intdigest(_PAIR.pack(key, position))
            logprob = -(h >> 40) / 2**22
            top = [(plain[(h + j) % len(plain)], logprob - j) for j in range(k)]
            seq.prompt_logprobs.append(TokenLogprob(seq.token_ids[position], logprob, top))

    def _onboard_seconds(self, run: Onboarded) -> float:
        return self.profile.onboard_s(run.tier, run.blocks * self.block_manager.block_size) / self.speedup

    def _write_kv(self, batch: list[tuple[Sequence, int]]) -> None:
        bs = self.block_manager.block_size
        slots, values = [], []
        for seq, n in batch:
            start = seq.num_computed_tokens
            slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n)]
            values += seq.token_ids[start:start + n]
        self._kv_slots[:, slots] = np.array(values, dtype=np.float32)[:, None]

    def _sample(self, seq: Sequence) -> tuple[int, TokenLogprob | None]:
        h = xxhash.xxh3_64_intdigest(_PAIR.pack(self._key(seq), len(seq.token_ids)))
        plain = self.tokenizer.plain
        token = plain[h % len(plain)] if seq.grammar is None else self._allowed(seq.grammar, h)
        bias = seq.request.sampling.logit_bias
        if bias and seq.grammar is None:
            token = self._biased(h, bias)
        top_k = seq.request.sampling.logprobs
        if top_k is None:
            return token, None
        logprob = -(h >> 40) / 2**22  # in (-4, 0]
        top = [(plain[(h + j) % len(plain)], logprob - j) for j in range(top_k)]  # the sampled token first
        return token, TokenLogprob(token, logprob, top)

    def _biased(self, h: int, bias: dict[int, float]) -> int:
        """The pick under `bias`: the hashed pick at _PICK_LOGIT, the first plain token after it that no bias
        names at 0 (a pick biased down gives way to it), each biased token at its bias; the highest wins."""
        plain = self.tokenizer.plain
        pick, j = plain[h % len(plain)], 1
        while plain[(h + j) % len(plain)] in bias:  # at most len(bias) steps
            j += 1
        scores = {**bias, plain[(h + j) % len(plain)]: 0.0}
        scores[pick] = scores.get(pick, 0.0) + _PICK_LOGIT
        return max(scores, key=lambda t: (scores[t], t == pick))

    def _allowed(self, matcher: GrammarMatcher, h: int) -> int:
        """A token the grammar allows next: a stop token if it allows one, else a plain one by `h` (any
        allowed one where it allows no plain token)."""
        allowed = allowed_tokens(matcher, self.model_config.vocab_size)
        stops = [t for t in sorted(self.eos_token_ids) if allowed[t]]
        if stops:
            return stops[0]
        choices = (allowed & self._plain_mask).nonzero()
        if not len(choices):
            choices = allowed.nonzero()
        return int(choices[h % len(choices)])

    def _key(self, seq: Sequence) -> int:
        key = self._keys.get(seq)
        if key is None:
            request, sampling = seq.request, seq.request.sampling
            # choice i of a seeded request draws as the request seeded seed + i, as the native engine's does
            unseeded = f"{request.request_id}/{seq.index}" if seq.index else request.request_id
            seed = unseeded if sampling.seed is None else str(sampling.seed + seq.index)
            salt = "" if sampling.greedy else seed
            key = xxhash.xxh3_64_intdigest(token_bytes(request.prompt_token_ids) + salt.encode())
            self._keys[seq] = key
        return key

    def _prompt_key(self, seq: Sequence) -> int:
        return xxhash.xxh3_64_intdigest(token_bytes(seq.request.prompt_token_ids))
