"""KV blocks: allocation, ref counts, prefix caching with LRU eviction, and the KV events they cause.

A full block, once computed, is offered to the prefix cache under its sequence hash
(router.hashing: chained, salted by cache_salt) and a BlockStored event is recorded. Freed
blocks keep their hash and wait in the free list, oldest first; allocating one that still has
a hash evicts it (BlockRemoved). Unhashed free blocks are handed out before cached ones.
With tiers (tiers.py) an evicted block is copied down first, and `admit` copies a prefix's blocks that a
lower tier holds back up (`lower_hits` finds them) instead of having them recomputed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from dynamo_pd.engines.native.sequence import Sequence
from dynamo_pd.engines.native.tiers import KVTiers
from router.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 tiers: KVTiers | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.tiers = tiers if enable_prefix_caching else None
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hit = [False] * num_blocks  # reused by a prefix hit since cached (the tiers' frequency filter)
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
        if not self.enable_prefix_caching or seq.scores_prompt:
            return []
        hits = []
        for h in seq.full_block_hashes(max_tokens // self.block_size):
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def lower_hits(self, seq: Sequence, start: int, max_tokens: int) -> int:
        """How many of `seq`'s blocks from block `start` on (within its first `max_tokens` tokens) the lower
        tiers hold in a row (none of them in the pool)."""
        if self.tiers is None or seq.scores_prompt:
            return 0
        count = 0
        for h in seq.full_block_hashes(max_tokens // self.block_size)[start:]:
            if h in self.cached or self.tiers.find(h) is None:
                break
            count += 1
        return count

    def admit(self, seq: Sequence, hits: list[int], num_tokens: int, lower: int = 0) -> bool:
        """Give a sequence with no blocks the cached `hits` plus new blocks up to `num_tokens`, the first
        `lower` of them copied back from the tiers (as many as can be: the rest are computed)."""
        new = self.blocks_for(num_tokens) - len(hits)
        revived = sum(1 for b in hits if self.ref_counts[b] == 0)
        if new > len(self.free) - revived:
            return False
        for block in hits:
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1
            self.hit[block] = True
        seq.block_table = list(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_committed_blocks = len(hits)
        self._allocate(seq, new)
        if lower:
            self._onboard(seq, len(hits), lower)
        return True

    def _onboard(self, seq: Sequence, start: int, count: int) -> None:
        table, hashes = seq.block_table, seq.block_hashes
        done, events = self.tiers.onboard([(hashes[i], table[i]) for i in range(start, start + count)])
        for i in range(start, start + done):
            self.block_hash[table[i]] = hashes[i]
            self.cached[hashes[i]] = table[i]
            self.hit[table[i]] = True  # reused: it goes back down to disk when evicted again
        for event in events:
            self._record(event)
        self._record_stored(seq, list(range(start, start + done)))
        seq.num_committed_blocks = start + done
        seq.num_computed_tokens = (start + done) * self.block_size

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]] | None:
        """`child` (no blocks yet) shares `parent`'s computed full blocks, a reference on each, and their
        prefix-cache state. A partial last block, which the child writes next, is copied on write: a new block
        of the child's own, returned as (parent's block, child's block) for the caller to copy the KV of.
        None: no free block for that copy."""
        full, partial = divmod(parent.num_computed_tokens, self.block_size)
        if partial and not self.free:
            return None
        for block in parent.block_table[:full]:
            self.ref_counts[block] += 1
        child.block_table = parent.block_table[:full]
        child.block_hashes = parent.block_hashes[:full]
        child.num_committed_blocks = min(parent.num_committed_blocks, full)
        child.num_computed_tokens = parent.num_computed_tokens
        if not partial:
            return []
        self._allocate(child, 1)
        return [(parent.block_table[full], child.block_table[-1])]

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make `seq`'s block table cover `num_tokens`; False when the free list is too short."""
        new = self.blocks_for(num_tokens) - len(seq.block_table)
        if new > len(self.free):
            return False
        self._allocate(seq, new)
        return True

    def _allocate(self, seq: Sequence, count: int) -> None:
        evicted, moved = [], []
        for _ in range(count):
            block, _ = self.free.popitem(last=False)
            h = self.block_hash[block]
            if h is not None:
                del self.cached[h]
                self.block_hash[block] = None
                evicted.append(h)
                if self.tiers is not None:  # copied down before its memory is reused
                    moved += self.tiers.offload(h, block, self.hit[block])
            self.hit[block] = False
            self.ref_counts[block] = 1
            seq.block_table.append(block)
        if evicted:
            self._record(BlockRemoved(block_hashes=evicted))
        for event in moved:
            self._record(event)

    def release(self, seq: Sequence) -> None:
        """Drop `seq`'s references; tail blocks first, so they are evicted before shared prefixes."""
        self.unpin(seq.block_table)
        seq.block_table = []
        seq.num_committed_blocks = 0

    def pin(self, hashes: list[int]) -> list[int]:
        """Take a reference on the cached blocks holding the longest prefix of `hashes` (a peer reads them):
        they stay until `unpin`."""
        blocks = []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1
            self.hit[block] = True  # a peer reuses it
            blocks.append(block)
        return blocks

    def unpin(self, blocks: list[int]) -> None:
        """Drop one reference on each of `blocks`, the last first (the eviction order `release` keeps)."""
        for block in reversed(blocks):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
                if self.block_hash[block] is None:
                    self.free.move_to_end(block, last=False)

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
        """Forget every hash, the tiers' too (blocks in use keep their data, they stop being shareable)."""
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        if self.tiers is not None:
            self.tiers.clear()
        self._record(AllBlocksCleared())
