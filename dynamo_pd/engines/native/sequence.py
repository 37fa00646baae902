"""One request's state inside the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dynamo_pd.engines.native.detokenizer import IncrementalDetokenizer
from dynamo_pd.protocol import EngineOutput, EngineRequest, TokenLogprob, Usage
from router.hashing import chain_hash, local_hash, salt_root

if TYPE_CHECKING:
    from xgrammar import GrammarMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued for blocks (new, or preempted and recomputing)
    LOADING = "loading"  # DECODE role: blocks reserved, prompt KV arriving through the kv_loader
    FORK = "fork"  # n > 1: a choice waiting for its prompt's end, where it joins the first (EngineCore._fork)
    RUNNING = "running"
    HELD = "held"  # PREFILL role: finished, prompt blocks held for the decode side
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request: EngineRequest
    block_size: int
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None  # per-request seed; None draws from the engine's generator
    token_ids: list[int] = field(init=False)  # prompt, then every token sampled so far
    num_prompt_tokens: int = field(init=False)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache served at first admission
    num_committed_blocks: int = 0  # leading full blocks already offered to the prefix cache
    block_hashes: list[int] = field(default_factory=list)  # sequence hashes of full blocks, lazily
    needs_load: bool = False  # DECODE role: the prompt's KV comes from elsewhere
    peer_load: bool = False  # a peer holds a prefix of it (request.kv_prefix): read before computing the rest
    grammar: GrammarMatcher | None = None  # structured output: what the grammar allows next (grammar.py)
    index: int = 0  # the choice (SamplingParams.n > 1)
    given_token: int | None = None  # its first token, sampled (and streamed) by a prefill worker: echoed here
    forks: list[Sequence] = field(default_factory=list)  # the first choice's: the other n - 1, made with it
    # SamplingParams.prompt_logprobs: one per prompt token computed so far (the first None)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.request.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        if self.request.sampling.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        given = [self.request.first_token_id, *self.request.fork_token_ids]
        if self.index < len(given):
            self.given_token = given[self.index]

    @property
    def scores_prompt(self) -> bool:
        """Its prompt's logprobs are asked for and not all computed here yet: its prompt is computed, never
        read from the prefix cache, the tiers or a peer (a DECODE load computes none: the prefill sent them)."""
        return (self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens
                and not self.needs_load)


    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def append(self, token: int, logprob: TokenLogprob | None, *, eos_token_ids: frozenset[int],
               max_model_len: int, prefill: bool, echo: bool = False) -> EngineOutput:
        """Add a sampled token and decide by the one stop rule of the engines run here (native, llama.cpp):
        stop token, EOS, stop string, then length. `echo`: the first token, sampled and streamed by a
        prefill worker; its text is what that side streamed by the same holdback rule, so this side's
        text starts after it. A prefill that does not end the request ends as "prefill_done". Under a
        grammar the token moves its matcher (which rebuilds it, for tokens sampled elsewhere) and the request
        stops where the grammar ends; a token the grammar refuses (sampled elsewhere) ends it in error."""
        self.token_ids.append(token)
        stop = self.request.stop
        finish = stop_reason = None
        if self.grammar is not None and not self.grammar.accept_token(token):
            return EngineOutput(request_id=self.request_id, token_ids=[token], finish_reason="error",
                                error=f"token {token} does not follow the request's grammar")
        if token in stop.stop_token_ids:
            finish, stop_reason = "stop", token
        elif token in eos_token_ids and not stop.ignore_eos:
            finish = "stop"
        elif (matched := self.detokenizer.add(token)) is not None:
            finish, stop_reason = "stop", matched
        if finish is None and self.grammar is not None and self.grammar.is_terminated():
            finish = "stop"  # the grammar is complete (its stop token accepted; with ignore_eos too)
        if finish is None and (len(self.output_token_ids) >= stop.max_tokens or len(self.token_ids) >= max_model_len):
            finish = "length"
        if echo:
            self.detokenizer.delta(finished=False)
        text = self.detokenizer.delta(finished=finish is not None)
        if prefill and finish is None:
            finish = "prefill_done"  # the decode side goes on; a first token that ends the request is the answer
        return EngineOutput(request_id=self.request_id, token_ids=[token], text=text,
                            logprobs=None if logprob is None else [logprob], finish_reason=finish,
                            stop_reason=stop_reason)

    def usage(self) -> Usage:
        return Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=len(self.output_token_ids),
                     cached_tokens=self.num_cached_tokens or 0)

    def full_block_hashes(self, num_blocks: int) -> list[int]:
        """Chained hashes (router.hashing, salted by cache_salt) of the first `num_blocks` full blocks."""
        size = self.block_size
        parent = self.block_hashes[-1] if self.block_hashes else salt_root(self.request.cache_salt)
        for i in range(len(self.block_hashes), num_blocks):
            parent = chain_hash(parent, local_hash(self.token_ids[i * size:(i + 1) * size]))
            self.block_hashes.append(parent)
        return self.block_hashes[:num_blocks]
