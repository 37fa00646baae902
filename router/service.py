"""KvRouter: the facade the frontend calls. One instance per router process, used from its event loop.

    router = KvRouter(RouterConfig())       # block size: the first worker's (or RouterConfig.block_size)
    router.add_worker("p0", Role.PREFILL, capacity_blocks=4096, block_size=16)  # its KV events: router.ingestor
    placement = router.place(request_id, token_ids, local_prefill_tokens=0)   # Placement, or Overloaded
    placement.decode, placement.prefill     # where it runs: RouteDecisions (prefill None: decode prefills)
    placement.first_token()                 # its life, the one object the frontend reports it to:
    placement.succeeded(Role.PREFILL)       #   a worker did its part (its circuit breaker resets)
    placement.failed(Role.DECODE)           #   a worker broke it: its load leaves, its breaker trips
    placement.finished()                    #   the end: every worker's load for it leaves
    router.update_load_metrics(LoadMetrics(...))
    router.worker_failed("d0")              # the circuit breaker (router.breaker) beneath succeeded / failed
    router.place(..., exclude={"d0"})       # a retry or a migration: not on the workers that failed it
    router.place(..., explain=True)         # each RouteDecision lists the candidates and their scores

Pools (router.worker.Role): PREFILL (overlap + load), DECODE (load; overlap too when `local_prefill`,
i.e. the decode worker prefills the prompt itself), AGGREGATED (overlap + load). `place` picks the pools:
AGGREGATED when there is no decode worker; else DECODE, and PREFILL unless the decode worker may prefill
the uncached prompt itself (at most `local_prefill_tokens`) or no prefill worker can take it.
`route` / `mark_prefill_done` / `mark_finished` are the one-pool steps beneath (tests, benchmarks):
a request id holds one placement per pool; mark_* apply to all of them unless a pool is named.
Where the prompt's prefix comes from is the route's too (RouteDecision.source): the chosen worker's pool, its
lower tiers (copied back), or a peer's pool it reads from (the time policy's fetch-or-recompute plans,
router/policies.py; peers are the workers added with lends_prefixes). `consider_peer` weighs a peer the
indexer no longer knows (a draining worker, for the requests it hands to migration).
A worker is busy when its active blocks reach `busy_kv_fraction` of its capacity or its pending prefill
tokens reach `busy_prefill_tokens`; busy workers are skipped, and when all are, route raises Overloaded.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

from router.breaker import CircuitBreaker
from router.hashing import block_hashes
from router.indexer import KvIndexer, WorkerId
from router.ingest import EventIngestor
from router.load import LoadKey, LoadTracker
from router.policies import (
    CacheAwarePolicy,
    Candidate,
    KvAwarePolicy,
    LeastLoadedPolicy,
    RandomPolicy,
    FetchPlan,
    RoundRobinPolicy,
    RouteRequest,
    RoutingPolicy,
    TimePolicy,
    local_plan,
)
from router.replica_sync import ReplicaSync
from router.worker import LoadMetrics, Role

PolicyName = Literal["time", "kv", "round_robin", "random", "least_loaded", "cache_aware"]
POLICIES: tuple[str, ...] = typing.get_args(PolicyName)


class RoutingError(RuntimeError):
    """No worker can take the request; the frontend answers 503."""


class NoWorkers(RoutingError):
    pass


class Overloaded(RoutingError):
    """Every worker of the pool is over its busy threshold; the frontend answers 429/503."""


class LayoutMismatch(ValueError):
    """A worker whose KV blocks the router cannot index with the others' (another block size)."""


@dataclass(frozen=True)
class RouterConfig:
    block_size: int | None = None  # None: the block size the first worker registers with
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


class Scored(typing.NamedTuple):
    """One candidate a route weighed (place(..., explain=True)): a trace's view of the choice."""

    worker_id: WorkerId
    overlap_blocks: int
    cost: float | None  # the policy's score, lowest wins (time: predicted seconds); None: it scores none


@dataclass(frozen=True)
class RouteDecision:
    worker_id: WorkerId
    pool: Role
    overlap_blocks: int  # leading prompt blocks already cached on the chosen worker
    cached_tokens: int  # prompt tokens it does not compute: cached, copied back from its tiers or read
    prompt_tokens: int
    candidates: tuple[Scored, ...] = ()  # explain=True: every worker not busy that it chose among
    source: str = "device"  # where the prefix comes from: "device", "tier" (copied back) or "peer" (read)
    peer: WorkerId | None = None  # source "peer": the worker whose pool it is read from
    peer_blocks: int = 0  # and how many leading blocks it reads (less what the worker has)


class Placement:
    """Where one request runs, and its life as the frontend reports it; the router's load follows."""

    def __init__(self, router: KvRouter, request_id: str, routes: dict[Role, RouteDecision],
                 prefill_refused: RoutingError | None = None) -> None:
        self.request_id, self.routes, self._router = request_id, routes, router
        self.prefill_refused = prefill_refused  # why no prefill worker took it, when one should have

    @property
    def decode(self) -> RouteDecision:
        """The worker that streams the answer: a decode worker, or an aggregated one."""
        return self.routes.get(Role.DECODE) or self.routes[Role.AGGREGATED]

    @property
    def prefill(self) -> RouteDecision | None:
        """The worker that computes the prompt; None: `decode` does."""
        return self.routes.get(Role.PREFILL)

    def first_token(self) -> None:
        """The client has its first token: the prompt is computed, and its pending prefill leaves the load."""
        self._router.mark_prefill_done(self.request_id)

    def succeeded(self, role: Role) -> None:
        """That worker did its part (a prefill handed off, a stream ended well): its breaker resets."""
        self._router.worker_succeeded(self.routes[role].worker_id)

    def failed(self, role: Role) -> float:
        """That worker broke the request (the frontend goes on without it): its load leaves now, and it
        stays out of routing for the seconds returned (router.breaker)."""
        self._router.mark_finished(self.request_id, role)
        return self._router.worker_failed(self.routes[role].worker_id)

    def finished(self, ttft_s: float = 0.0, itl_s: float = 0.0) -> None:
        """Done, aborted or failed: every worker's predicted load for it leaves (again is harmless). A
        request that streamed to its end gives the TTFT and mean ITL its client saw (the planner's)."""
        self._router.mark_finished(self.request_id, ttft_s=ttft_s, itl_s=itl_s)


class KvRouter:
    def __init__(self, config: RouterConfig | None = None) -> None:
        self.config = config = config or RouterConfig()
        if not 0 < config.busy_kv_fraction <= 1:
            raise ValueError(f"busy_kv_fraction must be in (0, 1], got {config.busy_kv_fraction}")
        self.policy = config.make_policy()
        self.indexer = KvIndexer(config.max_indexed_blocks)
        self.block_size: int | None = config.block_size  # every worker's; None until the first registers
        self.ingestor = EventIngestor(self.indexer, config.block_size or 1)  # its block size: set with ours
        self.load = LoadTracker()
        self._pool_of: dict[WorkerId, Role] = {}
        self._lends: set[WorkerId] = set()  # workers that lend their cached prefixes to peers and read theirs
        self._sync: ReplicaSync | None = None
        self.breaker = CircuitBreaker()

    # -- workers -----------------------------------------------------------------------------------
    def add_worker(self, worker_id: WorkerId, pool: Role | str, capacity_blocks: int,
                   block_size: int | None = None, lends_prefixes: bool = False) -> None:
        """Raises LayoutMismatch for a worker whose block size is not the others' (its KV events and
        prompts would hash to other blocks). `lends_prefixes`: peers may read its cached prefixes, and it
        theirs (WorkerInfo.kv_peer_prefixes)."""
        try:
            role = Role(pool)
        except ValueError:
            raise ValueError(f"unknown pool {pool!r}; choose one of {', '.join(r.value for r in Role)}") from None
        if block_size is None and self.block_size is None:
            raise ValueError(f"worker {worker_id!r}: no block size, and the router has none yet")
        if block_size is not None and block_size != (self.block_size or block_size):
            raise LayoutMismatch(f"worker {worker_id!r} has KV block size {block_size}, the router {self.block_size}")
        if block_size is not None and self.block_size is None:
            self.block_size = self.ingestor.block_size = block_size
        self.load.add_worker(worker_id, capacity_blocks)
        self._pool_of[worker_id] = role
        if lends_prefixes:
            self._lends.add(worker_id)

    def remove_worker(self, worker_id: WorkerId) -> None:
        """The worker left (lease expired, died): forget its blocks and load."""
        self._pool_of.pop(worker_id, None)
        self._lends.discard(worker_id)
        self.breaker.forget(worker_id)
        self.load.remove_worker(worker_id)
        self.ingestor.remove_worker(worker_id)
        if not self._pool_of and self.config.block_size is None:  # the next workers may bring another size
            self.block_size = None

    def workers(self, pool: Role | str) -> list[WorkerId]:
        return [w for w, p in self._pool_of.items() if p == pool]

    def indexed_blocks(self, worker_id: WorkerId) -> int:
        """The worker's blocks the indexer holds."""
        return self.indexer.blocks_of(worker_id)

    def attach_replica_sync(self, sync: ReplicaSync) -> None:
        self._sync = sync

    def worker_failed(self, worker_id: WorkerId) -> float:
        """A worker broke a request (died, stalled, its stream dropped): out of routing for a while
        (returned, in seconds), longer with each failure in a row. One that left is not remembered."""
        return self.breaker.failed(worker_id) if worker_id in self._pool_of else 0.0

    def worker_succeeded(self, worker_id: WorkerId) -> None:
        self.breaker.succeeded(worker_id)

    # -- requests ----------------------------------------------------------------------------------
    def place(self, request_id: str, token_ids: Sequence[int], salt: str | None = None, *,
              local_prefill_tokens: int = 0, exclude: Collection[WorkerId] = (),
              explain: bool = False) -> Placement:
        """The frontend's one question: which workers serve this request (the prompt hashed once),
        none of them in `exclude`; `explain`: each decision lists the candidates it weighed."""
        if not token_ids:
            raise ValueError(f"request {request_id!r}: empty prompt")
        if self.block_size is None:
            raise NoWorkers("no workers are registered")
        hashes = block_hashes(token_ids, self.block_size, salt)
        if not self.workers(Role.DECODE):
            return Placement(self, request_id, {Role.AGGREGATED: self.route(Role.AGGREGATED, request_id, token_ids,
                                                                            hashes=hashes, exclude=exclude,
                                                                            explain=explain)})
        remote = bool(self.workers(Role.PREFILL))
        local = local_prefill_tokens > 0 or not remote  # only then does overlap on the decode worker matter
        decode = self.route(Role.DECODE, request_id, token_ids, local_prefill=local, hashes=hashes,
                            exclude=exclude, explain=explain)
        routes = {Role.DECODE: decode}
        if not remote or (local and len(token_ids) - decode.cached_tokens <= local_prefill_tokens):
            return Placement(self, request_id, routes)
        try:
            routes[Role.PREFILL] = self.route(Role.PREFILL, request_id, token_ids, hashes=hashes,
                                              exclude=exclude, explain=explain)
        except RoutingError as exc:
            return Placement(self, request_id, routes, prefill_refused=exc)
        return Placement(self, request_id, routes)

    def route(
        self,
        pool: Role | str,
        request_id: str,
        token_ids: Sequence[int],
        salt: str | None = None,
        local_prefill: bool = False,
        hashes: Sequence[int] | None = None,  # the prompt's block_hashes, when the caller has them already
        exclude: Collection[WorkerId] = (),
        explain: bool = False,
    ) -> RouteDecision:
        if not token_ids:
            raise ValueError(f"request {request_id!r}: empty prompt")
        if pool not in tuple(Role):
            raise NoWorkers(f"unknown pool {pool!r}; choose one of {', '.join(r.value for r in Role)}")
        pool = Role(pool)
        workers = [w for w in self.workers(pool) if w not in exclude]
        if not workers:
            raise NoWorkers(f"no {pool.value} workers are registered"
                            + (f" besides {', '.join(sorted(exclude))}" if exclude else ""))
        # workers whose breaker is open sit out, unless that leaves none: then they are tried anyway
        workers = [w for w in workers if not self.breaker.is_open(w)] or workers
        block_size = self.block_size
        uses_overlap = pool is not Role.DECODE or local_prefill
        if uses_overlap and hashes is None:
            hashes = block_hashes(token_ids, block_size, salt)
        # one dict of every matched worker: cheaper than asking the Overlaps about each pool worker
        matches = self.indexer.find_matches(hashes).to_dict() if uses_overlap else {}
        request = RouteRequest(len(token_ids), block_size, prefill=uses_overlap)
        # the two lenders whose pools hold the longest prefix: a candidate's peer is the first but itself
        peers = sorted(((n, w) for w, n in matches.items() if w in self._lends), key=lambda p: p[0])[-2:][::-1]
        candidates = [self._candidate(w, matches, hashes if uses_overlap else None, peers) for w in workers]
        free = [c for c in candidates if not self._busy(c)]
        if not free:
            raise Overloaded(
                f"all {len(candidates)} {pool.value} workers are busy (KV use >= "
                f"{self.config.busy_kv_fraction:.0%} or pending prefill >= "
                f"{self.config.busy_prefill_tokens or 'unlimited'} tokens)"
            )
        chosen, plan = self._choose(free, request)
        overlap, covered = chosen.overlap_blocks, plan.covered_blocks
        prefill_tokens = max(0, len(token_ids) - covered * request.block_size) if uses_overlap else 0
        # a worker that computes the prompt holds its prefix once for all requests sharing it
        self._place(LoadKey(request_id, pool), chosen.worker_id, prefill_tokens, request.request_blocks,
                    hashes if uses_overlap else ())
        fetched = dict(source=plan.source, peer=plan.peer, peer_blocks=covered if plan.peer is not None else 0)
        weighed = self._explain(free, request) if explain else ()
        return RouteDecision(chosen.worker_id, pool, overlap, covered * request.block_size, len(token_ids),
                             weighed, **fetched)

    def _candidate(self, w: WorkerId, matches: dict[WorkerId, int], hashes: Sequence[int] | None,
                   peers: list[tuple[int, WorkerId]]) -> Candidate:
        """`w` as a policy weighs it; with the prompt's `hashes` (it computes the prompt), also what its tiers
        hold past its overlap, its fetch costs and the lender it may read a longer prefix from."""
        overlap = matches.get(w, 0)
        c = Candidate(overlap, self.load.load(w), self.indexer.blocks_of(w), self.load.costs(w))
        if hashes is None:
            return c
        peer, depth = next(((p, n) for n, p in peers if p != w), (None, 0)) if w in self._lends else (None, 0)
        return c._replace(lower_blocks=self.indexer.lower_run(w, hashes, overlap), fetch=self.load.fetch_costs(w),
                          peer=peer, peer_blocks=depth)

    def _choose(self, candidates: list[Candidate], request: RouteRequest) -> tuple[Candidate, FetchPlan]:
        if isinstance(self.policy, TimePolicy):
            return self.policy.choose_plan(candidates, request)
        chosen = self.policy.choose(candidates, request)
        return chosen, local_plan(chosen)  # its engine copies its tier blocks back; only `time` weighs peers

    def consider_peer(self, decision: RouteDecision, token_ids: Sequence[int], salt: str | None, peer: WorkerId,
                      peer_blocks: int) -> RouteDecision:
        """`peer` (which the indexer may no longer know: a draining worker) holds the prompt's first
        `peer_blocks` blocks: the decision's worker reads them from it if that is predicted sooner than where
        its prefix comes from now (with a policy other than `time`: whenever it holds more)."""
        w = decision.worker_id
        if w not in self._pool_of or w not in self._lends or peer_blocks <= decision.cached_tokens // self.block_size:
            return decision
        hashes = block_hashes(token_ids, self.block_size, salt)
        c = self._candidate(w, {w: decision.overlap_blocks}, hashes, [(peer_blocks, peer)])
        request = RouteRequest(len(token_ids), self.block_size)
        if isinstance(self.policy, TimePolicy):
            _, plan = TimePolicy.best_plan(c, TimePolicy.pool_costs([c]), TimePolicy.fleet_fetch([c])[0], request)
        else:
            whole = (len(token_ids) - 1) // self.block_size
            plan = FetchPlan("peer", min(peer_blocks, whole), peer=peer)
        if plan.peer is None:
            return decision
        return dataclasses.replace(decision, cached_tokens=plan.covered_blocks * self.block_size, source="peer",
                                   peer=peer, peer_blocks=plan.covered_blocks)

    def mark_prefill_done(self, request_id: str, pool: Role | str | None = None) -> None:
        for key in self._keys(request_id, pool):
            if self.load.prefill_done(key) and self._sync is not None:
                self._sync.publish("prefill_done", key)

    def mark_finished(self, request_id: str, pool: Role | str | None = None, ttft_s: float = 0.0,
                      itl_s: float = 0.0) -> None:
        for key in self._keys(request_id, pool):
            if self.load.finish(key) and self._sync is not None:
                self._sync.publish("finish", key, ttft_s=ttft_s, itl_s=itl_s)

    def update_load_metrics(self, metrics: LoadMetrics) -> None:
        if metrics.worker_id in self._pool_of:
            self.load.report(metrics)

    def _explain(self, candidates: list[Candidate], request: RouteRequest) -> tuple[Scored, ...]:
        scores = getattr(self.policy, "costs", None)
        costs = scores(candidates, request) if scores is not None else [None] * len(candidates)
        return tuple(Scored(c.worker_id, c.overlap_blocks, cost) for c, cost in zip(candidates, costs))

    def _busy(self, c: Candidate) -> bool:
        cfg = self.config
        return (
            c.load.blocks >= cfg.busy_kv_fraction * c.load.capacity_blocks
            or 0 < cfg.busy_prefill_tokens <= c.load.prefill_tokens
        )

    def _place(self, key: LoadKey, worker_id: WorkerId, prefill_tokens: int, blocks: int,
               hashes: Sequence[int]) -> None:
        self.load.place(key, worker_id, prefill_tokens, blocks, hashes)
        if self._sync is not None:
            self._sync.publish("place", key, worker_id, prefill_tokens, blocks, hashes=hashes)

    def _keys(self, request_id: str, pool: Role | str | None) -> list[LoadKey]:
        return [LoadKey(request_id, Role(p)) for p in ((pool,) if pool else Role)]
