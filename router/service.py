"""KvRouter: the facade the frontend calls. One instance per router process, used from its event loop.

    router = KvRouter(RouterConfig(block_size=16))
    router.add_worker("p0", "prefill", capacity_blocks=4096)         # its KV events: router.ingestor.follow
    decision = router.route("prefill", request_id, token_ids)        # RouteDecision or Overloaded
    router.mark_prefill_done(request_id)  # first token
    router.mark_finished(request_id)      # done, aborted or failed: frees the predicted load
    router.update_load_metrics(LoadMetrics(...))

Pools: "prefill" (overlap + load), "decode" (load; overlap too when `local_prefill=True`, i.e. the
decode worker prefills the prompt itself), "aggregated" (overlap + load). A request id may hold one
placement per pool; mark_* apply to all of them unless a pool is named.
A worker is busy when its active blocks reach `busy_kv_fraction` of its capacity or its pending prefill
tokens reach `busy_prefill_tokens`; busy workers are skipped, and when all are, route raises Overloaded.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from router.hashing import block_hashes
from router.indexer import KvIndexer, WorkerId
from router.ingest import EventIngestor
from router.load import LoadMetrics, LoadTracker
from router.policies import (
    CacheAwarePolicy,
    Candidate,
    KvAwarePolicy,
    LeastLoadedPolicy,
    RandomPolicy,
    RoundRobinPolicy,
    RouteRequest,
    RoutingPolicy,
    TimePolicy,
)
from router.replica_sync import ReplicaSync

Pool = Literal["prefill", "decode", "aggregated"]
POOLS: tuple[str, ...] = ("prefill", "decode", "aggregated")
PolicyName = Literal["time", "kv", "round_robin", "random", "least_loaded", "cache_aware"]
POLICIES: tuple[str, ...] = typing.get_args(PolicyName)


class RoutingError(RuntimeError):
    """No worker can take the request; the frontend answers 503."""


class NoWorkers(RoutingError):
    pass


class Overloaded(RoutingError):
    """Every worker of the pool is over its busy threshold; the frontend answers 429/503."""


@dataclass(frozen=True)
class RouterConfig:
    block_size: int = 16
    policy: PolicyName = "time"
    overlap_weight: float = 1.0
    temperature: float = 0.0
    busy_kv_fraction: float = 0.95
    busy_prefill_tokens: int = 0  # 0: no limit
    max_indexed_blocks: int = 0  # 0: unbounded
    seed: int | None = None

    def make_policy(self) -> RoutingPolicy:
        if self.policy == "time":
            return TimePolicy(self.seed)
        if self.policy == "kv":
            return KvAwarePolicy(self.overlap_weight, self.temperature, self.seed)
        if self.policy == "round_robin":
            return RoundRobinPolicy()
        if self.policy == "random":
            return RandomPolicy(self.seed)
        if self.policy == "least_loaded":
            return LeastLoadedPolicy(self.seed)
        if self.policy == "cache_aware":
            return CacheAwarePolicy(seed=self.seed)
        raise ValueError(
            f"unknown routing policy {self.policy!r}; choose one of {', '.join(POLICIES)}"
        )


@dataclass(frozen=True)
class RouteDecision:
    worker_id: WorkerId
    pool: str
    overlap_blocks: int  # leading prompt blocks already cached on the chosen worker
    cached_tokens: int
    prompt_tokens: int


class KvRouter:
    def __init__(self, config: RouterConfig | None = None) -> None:
        self.config = config = config or RouterConfig()
        if not 0 < config.busy_kv_fraction <= 1:
            raise ValueError(f"busy_kv_fraction must be in (0, 1], got {config.busy_kv_fraction}")
        self.policy = config.make_policy()
        self.indexer = KvIndexer(config.max_indexed_blocks)
        self.ingestor = EventIngestor(self.indexer, config.block_size)
        self.load = LoadTracker()
        self._pool_of: dict[WorkerId, str] = {}
        self._sync: ReplicaSync | None = None

    # -- workers -----------------------------------------------------------------------------------
    def add_worker(self, worker_id: WorkerId, pool: Pool, capacity_blocks: int) -> None:
        if pool not in POOLS:
            raise ValueError(f"unknown pool {pool!r}; choose one of {', '.join(POOLS)}")
        self.load.add_worker(worker_id, capacity_blocks)
        self._pool_of[worker_id] = pool

    def remove_worker(self, worker_id: WorkerId) -> None:
        """The worker left (lease expired, died): forget its blocks and load."""
        self._pool_of.pop(worker_id, None)
        self.load.remove_worker(worker_id)
        self.ingestor.remove_worker(worker_id)

    def workers(self, pool: Pool) -> list[WorkerId]:
        return [w for w, p in self._pool_of.items() if p == pool]

    def attach_replica_sync(self, sync: ReplicaSync) -> None:
        self._sync = sync

    # -- requests ----------------------------------------------------------------------------------
    def route(
        self,
        pool: Pool,
        request_id: str,
        token_ids: Sequence[int],
        salt: str | None = None,
        local_prefill: bool = False,
        hashes: Sequence[int] | None = None,  # the prompt's block_hashes, when the caller has them already
    ) -> RouteDecision:
        if not token_ids:
            raise ValueError(f"request {request_id!r}: empty prompt")
        workers = self.workers(pool)
        if not workers:
            raise NoWorkers(
                f"no {pool} workers are registered"
                if pool in POOLS
                else f"unknown pool {pool!r}; choose one of {', '.join(POOLS)}"
            )
        uses_overlap = pool != "decode" or local_prefill
        # one dict of every matched worker: cheaper than asking the Overlaps about each pool worker
        matches = (
            self.indexer.find_matches(
                block_hashes(token_ids, self.config.block_size, salt) if hashes is None else hashes).to_dict()
            if uses_overlap
            else {}
        )
        request = RouteRequest(len(token_ids), self.config.block_size, prefill=uses_overlap)
        candidates = [
            Candidate(matches.get(w, 0), self.load.load(w), self.indexer.blocks_of(w), self.load.costs(w))
            for w in workers
        ]
        free = [c for c in candidates if not self._busy(c)]
        if not free:
            raise Overloaded(
                f"all {len(candidates)} {pool} workers are busy (KV use >= "
                f"{self.config.busy_kv_fraction:.0%} or pending prefill >= "
                f"{self.config.busy_prefill_tokens or 'unlimited'} tokens)"
            )
        chosen = self.policy.choose(free, request)
        overlap = chosen.overlap_blocks
        prefill_tokens = max(0, len(token_ids) - overlap * request.block_size) if uses_overlap else 0
        self._place(f"{pool}:{request_id}", chosen.worker_id, prefill_tokens, request.request_blocks)
        return RouteDecision(chosen.worker_id, pool, overlap, overlap * request.block_size, len(token_ids))

    def mark_prefill_done(self, request_id: str, pool: Pool | None = None) -> None:
        for key in self._keys(request_id, pool):
            if self.load.prefill_done(key) and self._sync is not None:
                self._sync.publish("prefill_done", key)

    def mark_finished(self, request_id: str, pool: Pool | None = None) -> None:
        for key in self._keys(request_id, pool):
            if self.load.finish(key) and self._sync is not None:
                self._sync.publish("finish", key)

    def update_load_metrics(self, metrics: LoadMetrics) -> None:
        if metrics.worker_id in self._pool_of:
            self.load.report(metrics)

    def _busy(self, c: Candidate) -> bool:
        cfg = self.config
        return (
            c.load.blocks >= cfg.busy_kv_fraction * c.load.capacity_blocks
            or 0 < cfg.busy_prefill_tokens <= c.load.prefill_tokens
        )

    def _place(self, key: str, worker_id: WorkerId, prefill_tokens: int, blocks: int) -> None:
        self.load.place(key, worker_id, prefill_tokens, blocks)
        if self._sync is not None:
            self._sync.publish("place", key, worker_id, prefill_tokens, blocks)

    def _keys(self, request_id: str, pool: Pool | None) -> list[str]:
        return [f"{p}:{request_id}" for p in ((pool,) if pool else POOLS)]
