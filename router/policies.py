"""Routing policies: given the eligible workers (overlap and load of each), pick one.

All policies implement `choose(candidates, request) -> Candidate`; candidates are never empty
(the service filters busy workers first and raises Overloaded when none is left). Those that score
candidates also give the scores, `costs(candidates, request)` (the lowest wins), for a trace to show.

- TimePolicy (the default): the predicted seconds the request adds, on w, to its own latency and to
  that of the requests already there, from w's measured step costs (router.load.StepCosts: p seconds
  per prefill token, a decode step of B KV blocks takes d0 + d1 * B, L output tokens per request):
      uncached = prompt_tokens - overlap_w * block_size      (0 when the worker does not prefill)
      own      = p * (prefill_tokens_w + uncached)            its first token waits for the queued prefill
                 + L * (d0 + d1 * (blocks_w + request_blocks))  and its L steps carry w's active blocks
      others   = requests_w * (p * uncached + L * d1 * request_blocks)  each waits for its prefill and
                                                              carries its blocks for up to L steps
      cost_w   = own + others
  The minimum wins (random tie-break). p, d0, d1 and L are the candidates' medians (else PRIOR), the same
  for all: a pool's workers are alike (one model on one kind of device, as serve deploys them), and what
  each measured differs more by what it happened to serve than by what it is. On 16 identical mocker
  workers serving multi-turn chat their own p ran from 0.015 to 0.09 ms a token and their L from 32 to 64
  tokens (a worker that had served only health canaries); the cheapest-looking worker won, not the one
  holding the prefix. Only the load (queued prefill, blocks, requests) and the prefix are each worker's.
  Fetch or recompute: the prefix w has is not only its device overlap. Its engine copies the blocks its
  lower tiers hold past it back before the prefill (always: so they count, each at its tier's measured
  fixed cost and rate, router.load.FetchCosts), and it may read further blocks from the peer whose pool
  holds the longest prefix (a pull: the fixed cost of the peer's hold round trip plus bytes over the rate
  w measured pulling). So w has two plans, and the one that gives the request its first token sooner (`own`)
  stands for w, with its whole cost:
      local: covered = overlap_w + lower-tier blocks, fetch = onboard (copy-back) time
      peer:  covered = the peer's overlap,            fetch = onboard + pull time + one step
  with uncached = prompt_tokens - covered * block_size, `own` adding the fetch time and `others` the
  onboard time (copies back run on w's step thread; a pull does not). The step (d0 + d1 * blocks_w): a read
  starts as the scheduler admits the request, and the request joins the batch at the first step after the
  read ends, one step after it would have computed. No threshold: a pull wins only where it is predicted
  sooner than computing what it brings, for the request itself. Not by the whole cost: `others` prices each
  token computed at p, which a small chunk beside a decode batch does not cost them (on a GPU it rides the
  memory-bound step), and weighed in the plan's choice that had requests read the last 8 blocks of prompts seen
  before, a step later than computing them (kv_tiers, where the prefixes fit). FetchCosts a worker has not
  measured are the fleet's median, else FETCH_PRIOR; a worker that reports no block size fetches nothing.
- KvAwarePolicy: Dynamo's cost. For worker w,
      prefill_blocks = (prefill_tokens_w + prompt_tokens - overlap_w * block_size) / block_size
      decode_blocks  = blocks_w + request_blocks          (active blocks including this request)
      logit_w        = overlap_weight * prefill_blocks + decode_blocks
  temperature 0 picks the minimum (random tie-break); T > 0 samples softmax(-(logit - min) / range / T).
- RoundRobinPolicy, RandomPolicy, LeastLoadedPolicy (fewest requests, then blocks): baselines.
- CacheAwarePolicy: SGLang's router. When the load (requests) is imbalanced (max - min > abs_threshold
  and max > rel_threshold * min) take the least loaded; otherwise the longest prefix match if its match
  rate exceeds cache_threshold, else the worker with the smallest cache (fewest resident blocks).
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from router.events import LOWER_TIERS, TIER_HOST
from router.indexer import WorkerId
from router.load import FetchCosts, StepCosts, WorkerLoad

# Until some worker reports its figures: what the native engine's meter measured serving SmolLM2-135M
# (float32, one thread) on this project's 2-core CPU host, the default deployment, rounded; the API's
# default max_tokens (16) for the output.
PRIOR = StepCosts(prefill_s_per_token=2e-3, decode_s=0.05, decode_s_per_block=1e-3, output_tokens=16)
# Until some worker measured a fetch: what this project's 2-core host measured (benchmarks/transfer_bench.py:
# ZMQ pulls at ~1.4 GB/s after ~3 ms; page-cached file reads and memcpy faster), rounded down.
FETCH_PRIOR = FetchCosts(block_bytes=None, host_bytes_per_s=5e9, host_fixed_s=0.0, disk_bytes_per_s=1e9,
                         disk_fixed_s=0.0, pull_bytes_per_s=1e9, pull_fixed_s=5e-3)


@dataclass(frozen=True)
class RouteRequest:
    prompt_tokens: int
    block_size: int
    prefill: bool = True  # the chosen worker computes the uncached prompt (not a decode worker fed by transfer)

    @property
    def request_blocks(self) -> int:
        return -(-self.prompt_tokens // self.block_size)


class Candidate(NamedTuple):  # a NamedTuple: routing builds one per worker per request
    overlap_blocks: int
    load: WorkerLoad
    cached_blocks: int  # blocks of this worker resident in the indexer
    costs: StepCosts = StepCosts()  # what its steps cost, as it last reported
    lower_blocks: tuple[int, ...] = ()  # past the overlap: blocks its lower tiers hold in a row, per LOWER_TIERS
    fetch: FetchCosts = FetchCosts()  # what its fetches cost, as it last reported
    peer: WorkerId | None = None  # the peer whose pool holds the longest prefix (one it may pull from)
    peer_blocks: int = 0  # that prefix's blocks

    @property
    def worker_id(self):
        return self.load.worker_id


class FetchPlan(NamedTuple):
    """Where the chosen worker's prefix comes from (what goes in the placement)."""

    source: str  # "device": its pool; "tier": its lower tiers too (copied back); "peer": and a peer's pool
    covered_blocks: int  # the prompt's leading blocks it has or fetches
    fetch_s: float = 0.0  # predicted copy-back and pull time
    onboard_s: float = 0.0  # the copy-back part (on its step thread)
    peer: WorkerId | None = None


def local_plan(c: Candidate, f: FetchCosts | None = None) -> FetchPlan:
    """What the worker's engine does by itself: its overlap, then every lower-tier block copied back (timed
    by `f` when given: the fleet-filled figures)."""
    lower = sum(c.lower_blocks)
    if not lower:
        return FetchPlan("device", c.overlap_blocks)
    onboard = 0.0
    if f is not None and f.block_bytes:
        rates = {TIER_HOST: (f.host_fixed_s, f.host_bytes_per_s)}
        onboard = sum(fixed + n * f.block_bytes / rate for n, (fixed, rate) in
                      ((n, rates.get(tier, (f.disk_fixed_s, f.disk_bytes_per_s)))
                       for tier, n in zip(LOWER_TIERS, c.lower_blocks) if n))
    return FetchPlan("tier", c.overlap_blocks + lower, onboard, onboard)


class RoutingPolicy(Protocol):
    def choose(self, candidates: list[Candidate], request: RouteRequest) -> Candidate: ...


class KvAwarePolicy:
    def __init__(
        self, overlap_weight: float = 1.0, temperature: float = 0.0, seed: int | None = None
    ) -> None:
        if overlap_weight < 0 or temperature < 0:
            raise ValueError(
                f"overlap_weight and temperature must be >= 0, got {overlap_weight}, {temperature}"
            )
        self.overlap_weight = overlap_weight
        self.temperature = temperature
        self._rng = random.Random(seed)

    def logit(self, c: Candidate, request: RouteRequest) -> float:
        bs = request.block_size
        prefill_blocks = (c.load.prefill_tokens + request.prompt_tokens - c.overlap_blocks * bs) / bs
        decode_blocks = c.load.blocks + request.request_blocks
        return self.overlap_weight * prefill_blocks + decode_blocks

    def probabilities(self, candidates: list[Candidate], request: RouteRequest) -> list[float]:
        """Softmax of the negated, range-normalised logits (temperature > 0)."""
        logits = [self.logit(c, request) for c in candidates]
        low, spread = min(logits), (max(logits) - min(logits)) or 1.0
        weights = [math.exp(-(x - low) / spread / self.temperature) for x in logits]
        total = sum(weights)
        return [w / total for w in weights]

    def costs(self, candidates: list[Candidate], request: RouteRequest) -> list[float]:
        """Each candidate's logit (a trace shows them)."""
        return [self.logit(c, request) for c in candidates]

    def choose(self, candidates: list[Candidate], request: RouteRequest) -> Candidate:
        if self.temperature > 0:
            return self._rng.choices(candidates, self.probabilities(candidates, request))[0]
        logits = self.costs(candidates, request)
        best = min(logits)
        return self._rng.choice([c for c, x in zip(candidates, logits) if x == best])


class TimePolicy:
    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    @staticmethod
    def pool_costs(candidates: list[Candidate]) -> StepCosts:
        """The figures every candidate is costed with: the median of those they reported, else PRIOR's."""
        fields = zip(*(c.costs for c in candidates))
        return StepCosts(*(statistics.median(known) if (known := [x for x in values if x is not None]) else prior
                           for values, prior in zip(fields, PRIOR)))

    @staticmethod
    def fleet_fetch(candidates: list[Candidate]) -> list[FetchCosts]:
        """Each candidate's fetch figures, the unmeasured ones filled in (the candidates' median, else
        FETCH_PRIOR); a worker that reports no block size keeps none (it fetches nothing)."""
        fields = zip(*(c.fetch for c in candidates))
        fallback = [statistics.median(known) if (known := [x for x in values if x is not None]) else prior
                    for values, prior in zip(fields, FETCH_PRIOR)]
        return [FetchCosts(*(f if x is None else x for x, f in zip(c.fetch, fallback)))
                if c.fetch.block_bytes else FetchCosts() for c in candidates]

    @staticmethod
    def plans(c: Candidate, f: FetchCosts, request: RouteRequest) -> list[FetchPlan]:
        """The prefix sources `c` has: its own (pool and tiers), and a peer's pool when that holds more."""
        local = local_plan(c, f)
        if not request.prefill or not f.block_bytes or c.peer is None:
            return [local]
        peer_blocks = min(c.peer_blocks, (request.prompt_tokens - 1) // request.block_size)  # >= 1 computed
        if peer_blocks <= local.covered_blocks:
            return [local]
        pull_s = f.pull_fixed_s + (peer_blocks - local.covered_blocks) * f.block_bytes / f.pull_bytes_per_s
        return [local, FetchPlan("peer", peer_blocks, local.fetch_s + pull_s, local.onboard_s, c.peer)]

    @staticmethod
    def split_cost(c: Candidate, k: StepCosts, request: RouteRequest,
                   plan: FetchPlan | None = None) -> tuple[float, float]:
        """Predicted seconds of the request on `c`, its prefix from `plan` (None: the overlap alone): its own,
        and what it adds to the others'."""
        load, blocks = c.load, request.request_blocks
        covered, fetch_s, onboard_s = (c.overlap_blocks, 0.0, 0.0) if plan is None else plan[1:4]
        uncached = max(0, request.prompt_tokens - covered * request.block_size) if request.prefill else 0
        own = (k.prefill_s_per_token * (load.prefill_tokens + uncached) + fetch_s
               + k.output_tokens * (k.decode_s + k.decode_s_per_block * (load.blocks + blocks)))
        if plan is not None and plan.peer is not None:  # it joins the batch a step after its read
            own += k.decode_s + k.decode_s_per_block * load.blocks
        others = load.requests * (k.prefill_s_per_token * uncached + onboard_s
                                  + k.output_tokens * k.decode_s_per_block * blocks)
        return own, others

    @classmethod
    def best_plan(cls, c: Candidate, k: StepCosts, f: FetchCosts, request: RouteRequest) -> tuple[float, FetchPlan]:
        """The prefix source that gives `c`'s request its first token soonest, and its whole cost."""
        (own, others), plan = min(((cls.split_cost(c, k, request, plan), plan) for plan in cls.plans(c, f, request)),
                                  key=lambda scored: (scored[0][0], sum(scored[0])))
        return own + others, plan

    def scored(self, candidates: list[Candidate], request: RouteRequest) -> list[tuple[float, FetchPlan]]:
        """Each candidate's predicted seconds and the prefix source that gives them."""
        k = self.pool_costs(candidates)
        return [self.best_plan(c, k, f, request) for c, f in zip(candidates, self.fleet_fetch(candidates))]

    def choose_plan(self, candidates: list[Candidate], request: RouteRequest) -> tuple[Candidate, FetchPlan]:
        """The candidate with the least predicted seconds, and its prefix source."""
        scored = self.scored(candidates, request)
        best = min(cost for cost, _ in scored)
        return self._rng.choice([(c, plan) for c, (cost, plan) in zip(candidates, scored) if cost == best])

    def costs(self, candidates: list[Candidate], request: RouteRequest) -> list[float]:
        """Each candidate's predicted seconds (from its best prefix source)."""
        return [cost for cost, _ in self.scored(candidates, request)]

    def choose(self, candidates: list[Candidate], request: RouteRequest) -> Candidate:
        return self.choose_plan(candidates, request)[0]


class RoundRobinPolicy:
    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, candidates: list[Candidate], request: RouteRequest) -> Candidate:
        ordered = sorted(candidates, key=lambda c: str(c.worker_id))
        return ordered[next(self._turn) % len(ordered)]


class RandomPolicy:
    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, candidates: list[Candidate], request: RouteRequest) -> Candidate:
        return self._rng.choice(candidates)


class LeastLoadedPolicy:
    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, candidates: list[Candidate], request: RouteRequest) -> Candidate:
        return _least(candidates, lambda c: (c.load.requests, c.load.blocks), self._rng)


class CacheAwarePolicy:
    def __init__(
        self,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.1,
        seed: int | None = None,
    ) -> None:
        if not 0 <= cache_threshold <= 1:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self._rng = random.Random(seed)

    def choose(self, candidates: list[Candidate], request: RouteRequest) -> Candidate:
        loads = [c.load.requests for c in candidates]
        high, low = max(loads), min(loads)
        if high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low:
            return _least(candidates, lambda c: c.load.requests, self._rng)
        best = _least(candidates, lambda c: -c.overlap_blocks, self._rng)
        match_rate = best.overlap_blocks * request.block_size / max(1, request.prompt_tokens)
        if match_rate > self.cache_threshold:
            return best
        return _least(candidates, lambda c: c.cached_blocks, self._rng)


def _least(candidates: list[Candidate], key, rng: random.Random) -> Candidate:
    keys = [key(c) for c in candidates]
    best = min(keys)
    return rng.choice([c for c, k in zip(candidates, keys) if k == best])
