"""Continuous batching: which sequences compute how many tokens this step.

Running sequences go first, in admission order, each taking what it still needs (one token
when decoding, a chunk when prefilling) from the step's token budget. When blocks run out the
newest running sequence is preempted: its blocks are freed and it is recomputed later (its
full blocks usually come back from the prefix cache). Waiting sequences are admitted in FIFO
order while the budget, `max_num_seqs` and free blocks allow, and never in a step that had to
preempt.
"""

from __future__ import annotations

from collections import deque

from dynamo_pd.engines.native.block_manager import BlockManager
from dynamo_pd.engines.native.sequence import Sequence, SequenceStatus

ScheduledBatch = list[tuple[Sequence, int]]  # (sequence, tokens it computes this step)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: dict[str, Sequence] = {}  # DECODE role: blocks reserved, KV arriving
        self.new_loads: list[Sequence] = []  # admitted to `loading` since the engine last looked
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_active_prefill_tokens(self) -> int:
        return sum(max(0, s.num_prompt_tokens - s.num_computed_tokens) for s in (*self.waiting, *self.running))

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        batch: ScheduledBatch = []
        preempted = False
        i = 0
        while i < len(self.running) and budget:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.bm.grow(seq, seq.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                batch.append((seq, n))
                budget -= n
                i += 1
        while self.waiting and budget and not preempted and self._has_seq_slot():
            seq = self.waiting[0]
            if seq.needs_load:
                if not self._admit_for_load(seq):
                    break
                continue
            if seq.peer_load:
                admitted = self._admit_for_prefix(seq)
                if admitted is False:
                    break
                if admitted:
                    continue
            hits = self.bm.prefix_hits(seq, len(seq.token_ids) - 1)  # compute >= 1 token for logits
            lower = self.bm.lower_hits(seq, len(hits), len(seq.token_ids) - 1)  # copied back from the tiers
            cached = (len(hits) + lower) * self.bm.block_size
            n = min(len(seq.token_ids) - cached, budget)
            if not self.bm.admit(seq, hits, cached + n, lower):
                break
            if seq.num_cached_tokens is None:  # first admission; a recompute does not count
                seq.num_cached_tokens = seq.num_computed_tokens
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.append((seq, n))
            budget -= n
        return batch

    def _has_seq_slot(self) -> bool:
        return len(self.running) + len(self.loading) < self.max_num_seqs

    def _admit_for_load(self, seq: Sequence) -> bool:
        hits = self.bm.prefix_hits(seq, seq.num_prompt_tokens)
        if not self.bm.admit(seq, hits, seq.num_prompt_tokens):
            return False
        seq.num_cached_tokens = len(hits) * self.bm.block_size
        self.waiting.popleft()
        seq.status = SequenceStatus.LOADING
        self.loading[seq.request_id] = seq
        self.new_loads.append(seq)
        return True

    def _admit_for_prefix(self, seq: Sequence) -> bool | None:
        """Blocks for the prefix a peer holds, its local hits (and tier copies) in them; the rest is read from
        the peer (LOADING) before anything is computed. None: the peer would add nothing, admit as usual."""
        bs, last = self.bm.block_size, len(seq.token_ids) - 1  # compute >= 1 token for logits
        want = min(seq.request.kv_prefix.num_blocks, last // bs)
        hits = self.bm.prefix_hits(seq, last)
        lower = self.bm.lower_hits(seq, len(hits), last)
        if len(hits) + lower >= want:
            seq.peer_load = False
            return None
        if not self.bm.admit(seq, hits, want * bs, lower):
            return False
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = seq.num_computed_tokens
        self.waiting.popleft()
        seq.status = SequenceStatus.LOADING
        self.loading[seq.request_id] = seq
        self.new_loads.append(seq)
        return True

    def loaded_prefix(self, seq: Sequence, num_blocks: int) -> None:
        """The peer's read ended with the prefix's first `num_blocks` blocks in place (what the sequence had
        already when it failed): they join the prefix cache, and the rest is computed as it runs."""
        del self.loading[seq.request_id]
        seq.peer_load = False
        seq.num_computed_tokens = max(seq.num_computed_tokens, num_blocks * self.bm.block_size)
        seq.num_cached_tokens = seq.num_computed_tokens  # read, not computed: the request's cached tokens
        self.bm.commit(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def loaded(self, seq: Sequence) -> None:
        """The prompt's KV is in place: the sequence joins the running batch, decoding."""
        del self.loading[seq.request_id]
        seq.needs_load = False
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.bm.commit(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def join(self, choice: Sequence) -> None:
        """A choice forked at its prompt's end (its blocks shared, EngineCore._fork) runs beside the first."""
        choice.status = SequenceStatus.RUNNING
        self.running.append(choice)

    def _preempt(self, seq: Sequence) -> None:
        self.bm.release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of whichever queue holds it; its blocks stay until the caller releases them."""
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.LOADING:
            del self.loading[seq.request_id]
            if seq in self.new_loads:
                self.new_loads.remove(seq)
