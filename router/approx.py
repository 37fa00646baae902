"""Approximate KV indexing for workers that publish no KV events (an external OpenAI-compatible
server behind dynamo_pd.engines.http), as Dynamo's and SGLang's approximate modes do: the router
predicts such a worker's prefix cache from its own routing decisions. Every prompt routed to it
counts as cached there, block by block, for `ttl_s` after its last use, at most `max_blocks` blocks
per worker (the least recently used go first). A prediction, never a report: metrics mark it so.

    cache = ApproxCache(ttl_s=120)
    cache.routed("w0", seq_hashes, now)       # the worker got this prompt
    for worker, hashes in cache.expire(now).items(): indexer.remove(worker, hashes)

`ApproxKvRouter` is a KvRouter that does this for the workers `approximate(worker_id)` names.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from router.hashing import block_hashes
from router.indexer import WorkerId
from router.service import KvRouter, RouteDecision, RouterConfig


class ApproxCache:
    def __init__(self, ttl_s: float = 120.0, max_blocks: int = 1 << 16) -> None:
        if ttl_s <= 0 or max_blocks <= 0:
            raise ValueError(f"ttl_s and max_blocks must be positive, got {ttl_s}, {max_blocks}")
        self.ttl_s, self.max_blocks = ttl_s, max_blocks
        # per worker: seq hash -> expiry, in expiry order (every touch moves a block to the end)
        self._blocks: dict[WorkerId, OrderedDict[int, float]] = {}

    def routed(self, worker: WorkerId, seq_hashes: Sequence[int], now: float) -> list[int]:
        """Record a prompt routed to `worker`; returns the blocks evicted to stay within max_blocks."""
        blocks = self._blocks.setdefault(worker, OrderedDict())
        expiry = now + self.ttl_s
        for h in seq_hashes:
            blocks[h] = expiry
            blocks.move_to_end(h)
        evicted = []
        while len(blocks) > self.max_blocks:
            evicted.append(blocks.popitem(last=False)[0])
        return evicted

    def expire(self, now: float) -> dict[WorkerId, list[int]]:
        """The blocks whose time ran out, by worker (forgotten here)."""
        gone: dict[WorkerId, list[int]] = {}
        for worker, blocks in self._blocks.items():
            while blocks and next(iter(blocks.values())) <= now:
                gone.setdefault(worker, []).append(blocks.popitem(last=False)[0])
        return gone

    def blocks_of(self, worker: WorkerId) -> int:
        return len(self._blocks.get(worker, ()))

    def forget(self, worker: WorkerId) -> None:
        self._blocks.pop(worker, None)


class ApproxKvRouter(KvRouter):
    """A KvRouter whose `approximate` workers' cache is predicted from its own placements."""

    def __init__(self, config: RouterConfig | None = None, approximate: Callable[[WorkerId], bool] = lambda w: False,
                 ttl_s: float = 120.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(config)
        self.approximate, self.approx, self._clock = approximate, ApproxCache(ttl_s), clock

    def route(self, pool, request_id, token_ids, *args, **kwargs) -> RouteDecision:
        now = self._clock()
        for worker, hashes in self.approx.expire(now).items():
            self.indexer.remove(worker, hashes)
        decision = super().route(pool, request_id, token_ids, *args, **kwargs)
        if self.approximate(decision.worker_id):
            hashes = kwargs.get("hashes") or block_hashes(token_ids, self.block_size, kwargs.get("salt"))
            self.indexer.store(decision.worker_id, hashes)
            self.indexer.remove(decision.worker_id, self.approx.routed(decision.worker_id, hashes, now))
        return decision

    def remove_worker(self, worker_id: WorkerId) -> None:
        super().remove_worker(worker_id)
        self.approx.forget(worker_id)
