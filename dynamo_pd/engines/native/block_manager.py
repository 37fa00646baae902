"""KV blocks: allocation, ref counts, prefix caching with LRU eviction, and the KV events they cause.

A full block, once computed, is offered to the prefix cache under its sequence hash
(router.hashing: chained, salted by cache_salt) and a BlockStored event is recorded. Freed
blocks keep their hash and wait in the free list, oldest first; allocating one that still has
a hash evicts it (BlockRemoved). Unhashed free blocks are handed out before cached ones.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from dynamo_pd.engines.native.sequence import Sequence
from router.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # sequence hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # eviction order
        self._events: list[KVEvent] = []
        self._events_lock = threading.Lock()  # the step thread records, the worker drains

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def drain_events(self) -> list[KVEvent]:
        with self._events_lock:
            events, self._events = self._events, []
        return events

    def _record(self, event: KVEvent) -> None:
        with self._events_lock:
            self._events.append(event)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def prefix_hits(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Cached blocks holding the longest prefix of `seq`'s first `max_tokens` tokens."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for h in seq.full_block_hashes(max_tokens // self.block_size):
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def admit(self, seq: Sequence, hits: list[int], num_tokens: int) -> bool:
        """Give a sequence with no blocks the cached `hits` plus new blocks up to `num_tokens`."""
        new = self.blocks_for(num_tokens) - len(hits)
        revived = sum(1 for b in hits if self.ref_counts[b] == 0)
        if new > len(self.free) - revived:
            return False
        for block in hits:
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1
        seq.block_table = list(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_committed_blocks = len(hits)
        self._allocate(seq, new)
        return True

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make `seq`'s block table cover `num_tokens`; False when the free list is too short."""
        new = self.blocks_for(num_tokens) - len(seq.block_table)
        if new > len(self.free):
            return False
        self._allocate(seq, new)
        return True

    def _allocate(self, seq: Sequence, count: int) -> None:
        evicted = []
        for _ in range(count):
            block, _ = self.free.popitem(last=False)
            h = self.block_hash[block]
            if h is not None:
                del self.cached[h]
                self.block_hash[block] = None
                evicted.append(h)
            self.ref_counts[block] = 1
            seq.block_table.append(block)
        if evicted:
            self._record(BlockRemoved(block_hashes=evicted))

    def release(self, seq: Sequence) -> None:
        """Drop `seq`'s references; tail blocks first, so they are evicted before shared prefixes."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
                if self.block_hash[block] is None:
                    self.free.move_to_end(block, last=False)
        seq.block_table = []
        seq.num_committed_blocks = 0

    def commit(self, seq: Sequence) -> None:
        """Offer `seq`'s newly computed full blocks to the prefix cache."""
        full = seq.num_computed_tokens // self.block_size
        if not self.enable_prefix_caching or full <= seq.num_committed_blocks:
            return
        hashes = seq.full_block_hashes(full)
        run: list[int] = []  # consecutive newly cached blocks, reported as one event
        for i in range(seq.num_committed_blocks, full):
            block, h = seq.block_table[i], hashes[i]
            if self.block_hash[block] is None and h not in self.cached:
                self.block_hash[block] = h
                self.cached[h] = block
                run.append(i)
            else:  # already cached (a prefix hit, or the same content in another block)
                self._record_stored(seq, run)
                run = []
        self._record_stored(seq, run)
        seq.num_committed_blocks = full

    def _record_stored(self, seq: Sequence, run: list[int]) -> None:
        if not run:
            return
        size, first = self.block_size, run[0]
        self._record(BlockStored(
            block_hashes=[seq.block_hashes[i] for i in run],
            parent_block_hash=seq.block_hashes[first - 1] if first else None,
            token_ids=seq.token_ids[first * size:(run[-1] + 1) * size],
            block_size=size,
            lora_name=seq.request.cache_salt,
        ))

    def reset_prefix_cache(self) -> None:
        """Forget every hash (blocks in use keep their data, they just stop being shareable)."""
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        self._record(AllBlocksCleared())
