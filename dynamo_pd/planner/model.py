"""What a pool of n workers would give the next interval's load: predicted TTFT and ITL.

TTFT (prefill and aggregated pools): the interval is simulated, its requests' first tokens timed.
  arrivals  Poisson at the load's rate, prompts drawn from the recent ones (their uncached tokens)
  placement on the worker whose queued work ends first (the router's `time` policy)
  steps     each worker runs steps of up to chunk_tokens prefill tokens (--max-num-batched-tokens) from
            its queue in order, a step of k tokens taking c * k + s0 (c: seconds per prefill token; s0: the
            decode step an aggregated worker's chunks ride, 0 on a prefill worker, whose c carries it); a
            request's first token comes at the end of the step that computes its last prompt token
  state     the prefill queued now, spread over the n workers, ahead of every arrival
Chunking is why it is simulated: the step that finishes a prompt also starts the next one's, so a request
that arrives while one is computed delays that one too (benchmarks.planner_model sets it beside mocker
workers and beside whole-prompt steps, an M/D/n queue).
The share of the simulated requests within the SLO is the attainment, their median the predicted p50;
SIM_REQUESTS of them at least (the interval replayed from its start with new arrivals), on the same
random arrivals for every n so that counts compare without noise.
ITL (decode and aggregated pools): a decode step of B KV blocks takes d0 + d1 * B (the step costs
  workers measure, engines/native/step_costs.py), plus c * P for the P prefill tokens it carries.
  Requests in flight per worker: N = lambda * out * ITL / n (Little's law), each holding k = prompt
  blocks + out / 2 / block_size blocks on average, so ITL = d0 + d1 * k * N + c * lambda * L / n * ITL,
  solved for ITL; a worker of the pool holds N + z * sqrt(N) at the quantile asked for (Poisson
  imbalance), and N relaxes from the requests running now with the time constant out * ITL.
Beyond what a worker holds (max_num_seqs, KV blocks) or at rho >= 1 the pool cannot keep up: inf.
Both add what clients measure beyond the model (the frontend and transport, the hand-off's gap before
the second token, how evenly the router spreads the decode batch): Offsets the planner learns from the
latencies observed (dynamo_pd.planner.loop), 0 until then.
"""

from __future__ import annotations

import bisect
import math
import random
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property
from statistics import NormalDist

_KV_HEADROOM = 0.95  # past this share of its KV blocks a worker preempts: the ITL model no longer holds
SIM_REQUESTS = 1000  # simulated arrivals per worker count, at least: the median and a 90% share to ~2%
_SIM_REPLAYS = 50  # at most, for a load so light an interval holds few arrivals


@dataclass(frozen=True)
class Costs:
    """A pool's step costs (router.load.StepCosts, the pool's median): seconds."""

    prefill_s_per_token: float
    decode_s: float = 0.0
    decode_s_per_block: float = 0.0


@dataclass(frozen=True)
class Load:
    """A pool's predicted load over the next interval."""

    rate: float  # requests/s placed on the pool
    prompt_tokens: tuple[int, ...]  # uncached prompt tokens of recent requests: their lengths' shape
    prompt_blocks: float = 0.0  # mean KV blocks of a prompt (decode side)
    output_tokens: float = 0.0  # mean output tokens per request

    @cached_property
    def mean_prompt_tokens(self) -> float:
        return sum(self.prompt_tokens) / len(self.prompt_tokens) if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class State:
    """What the pool holds now."""

    queued_prefill_tokens: int = 0
    running: int = 0  # requests decoding


@dataclass(frozen=True)
class Offsets:
    """Measured minus modelled, seconds, added to what the model predicts; None: not measured yet (0)."""

    ttft_p50: float | None = None  # to every TTFT
    itl_mean: float | None = None  # to the mean ITL
    itl_quantile: float | None = None  # to the ITL at the attainment quantile (what decides)


@dataclass(frozen=True)
class Limits:
    """What one worker of the pool holds."""

    max_num_seqs: int
    kv_blocks: int
    block_size: int
    chunk_tokens: int  # prefill tokens per step (--max-num-batched-tokens)


@dataclass(frozen=True)
class Prediction:
    ttft_p50_s: float | None = None  # None: the pool serves no first tokens (decode)
    ttft_attainment: float | None = None  # share of requests predicted within the TTFT SLO
    itl_s: float | None = None  # mean; None: the pool decodes nothing (prefill)
    itl_quantile_s: float | None = None  # at the attainment asked for
    utilization: float = 0.0  # rho of the prefill work


@dataclass(frozen=True)
class PoolModel:
    """One pool's latency against its worker count; `prefills` / `decodes`: which latencies it serves."""

    costs: Costs
    load: Load
    state: State
    limits: Limits
    prefills: bool
    decodes: bool
    horizon_s: float
    attainment: float  # the share of requests each SLO must hold for (its quantile)
    offsets: Offsets = Offsets()
    _simulated: dict[int, list[float] | None] = field(default_factory=dict, init=False, repr=False,
                                                      compare=False)  # per worker count

    def _blocks_per_request(self) -> float:
        return self.load.prompt_blocks + self.load.output_tokens / 2 / self.limits.block_size

    def _inline_share(self, n: int) -> float:
        """The share of a step's time its prefill tokens take (prompts prefilled where they decode)."""
        return self.costs.prefill_s_per_token * self.load.rate * self.load.mean_prompt_tokens / n

    def _decode_steady(self, n: int) -> tuple[float, float] | None:
        """(ITL, requests per worker) at steady state, None when the pool cannot keep up."""
        c, load = self.costs, self.load
        per_itl = c.decode_s_per_block * self._blocks_per_request() * load.rate * load.output_tokens / n
        free = 1 - per_itl - self._inline_share(n)  # ITL * free = d0
        if free <= 0:
            return None
        itl = c.decode_s / free
        return itl, load.rate * load.output_tokens * itl / n

    def itl(self, n: int) -> tuple[float, float]:
        """(mean ITL, ITL at the attainment quantile) with n workers; inf where it cannot keep up."""
        steady = self._decode_steady(n)
        if steady is None:
            return math.inf, math.inf
        itl, held = steady
        c, limits, k = self.costs, self.limits, self._blocks_per_request()
        life = self.load.output_tokens * itl  # a request's decode time: how fast the running set turns over
        if life > 0 and self.horizon_s > 0:  # the mean over the horizon, relaxing from what runs now
            settled = 1 - life / self.horizon_s * (1 - math.exp(-self.horizon_s / life))
            held = held * settled + self.state.running / n * (1 - settled)
        peak = held + NormalDist().inv_cdf(self.attainment) * math.sqrt(max(held, 0.0))
        if peak > limits.max_num_seqs or peak * k > _KV_HEADROOM * limits.kv_blocks:
            return math.inf, math.inf
        free = 1 - self._inline_share(n)
        return ((c.decode_s + c.decode_s_per_block * k * held) / free + (self.offsets.itl_mean or 0.0),
                (c.decode_s + c.decode_s_per_block * k * peak) / free + (self.offsets.itl_quantile or 0.0))

    def _service(self, n: int) -> tuple[float, float]:
        """(seconds per prefill token, a step's fixed seconds) for a prompt on this pool."""
        c = self.costs
        if not self.decodes:
            return c.prefill_s_per_token, 0.0
        steady = self._decode_steady(n)
        held = 0.0 if steady is None else steady[1]
        return c.prefill_s_per_token, c.decode_s + c.decode_s_per_block * self._blocks_per_request() * held

    def _ttfts(self, n: int) -> list[float] | None:
        """The simulated requests' TTFTs, sorted, offset included; None past the pool's capacity."""
        if n not in self._simulated:
            self._simulated[n] = None if self.utilization(n) >= 1 else sorted(
                t + (self.offsets.ttft_p50 or 0.0) for t in _simulate(self, n))
        return self._simulated[n]

    def ttft_attainment(self, n: int, slo_s: float) -> float:
        """The share of requests predicted to see TTFT <= slo_s with n workers."""
        ttfts = self._ttfts(n)
        return 0.0 if ttfts is None else bisect.bisect_right(ttfts, slo_s) / len(ttfts)

    def ttft_quantile(self, n: int, q: float) -> float:
        """The predicted TTFT at quantile q with n workers (inf past the pool's capacity)."""
        ttfts = self._ttfts(n)
        return math.inf if ttfts is None else ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))]

    def ttft_p50(self, n: int) -> float:
        return self.ttft_quantile(n, 0.5)

    def ttft_p50_given(self, n: int, arrivals: list[tuple[float, int]]) -> float | None:
        """The median TTFT, offset included, of requests arriving as given (s from the interval's start,
        uncached prompt tokens) rather than at the load's rate: the model apart from the forecast (None
        without arrivals)."""
        ttfts = sorted(_serve(self, n, sorted(arrivals)))
        return ttfts[len(ttfts) // 2] + (self.offsets.ttft_p50 or 0.0) if ttfts else None

    def utilization(self, n: int) -> float:
        per_token, fixed = self._service(n)
        steps = math.ceil(self.load.mean_prompt_tokens / self.limits.chunk_tokens) or 1
        return self.load.rate * (per_token * self.load.mean_prompt_tokens + fixed * steps) / n

    def predict(self, n: int, ttft_slo_s: float) -> Prediction:
        ttft = (self.ttft_p50(n), self.ttft_attainment(n, ttft_slo_s)) if self.prefills else (None, None)
        itl = self.itl(n) if self.decodes else (None, None)
        return Prediction(ttft[0], ttft[1], itl[0], itl[1], self.utilization(n) if self.prefills else 0.0)

    def meets(self, n: int, ttft_slo_s: float, itl_slo_s: float) -> bool:
        if self.prefills and self.ttft_attainment(n, ttft_slo_s) < self.attainment:
            return False
        return not self.decodes or self.itl(n)[1] <= itl_slo_s


def _arrivals(rng: random.Random, rate: float, horizon_s: float) -> list[float]:
    """Poisson arrival times over [0, horizon]."""
    t, times = 0.0, []
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= horizon_s:
            break
        times.append(t)
    return times


def _simulate(model: PoolModel, n: int) -> list[float]:
    """TTFTs of the requests arriving over the interval (replayed until SIM_REQUESTS), on n workers that
    place each on the one whose work ends first and run chunked prefill steps (the module's docstring)."""
    rng, ttfts = random.Random(0), []  # seed 0: the same arrivals for every n
    prompts = model.load.prompt_tokens or (0,)
    for replay in range(_SIM_REPLAYS):
        # an interval without arrivals: what one arriving at its start would see
        times = _arrivals(rng, model.load.rate, model.horizon_s) or (
            [0.0] if replay == _SIM_REPLAYS - 1 and not ttfts else [])
        ttfts += _serve(model, n, [(t, rng.choice(prompts)) for t in times])
        if len(ttfts) >= SIM_REQUESTS:
            break
    return ttfts


def _serve(model: PoolModel, n: int, arrivals: list[tuple[float, int]]) -> list[float]:
    """The TTFTs of requests arriving as (s from the interval's start, in order; uncached prompt tokens) on n
    workers, behind the prefill queued now."""
    per_token, fixed = model._service(n)
    ttfts: list[float] = []
    workers = [_Worker(per_token, fixed, model.limits.chunk_tokens, model.state.queued_prefill_tokens / n)
               for _ in range(n)]
    for t, tokens in arrivals:
        worker = min(workers, key=lambda w: w.done_at)
        worker.run_until(t, ttfts)
        worker.add(t, max(1, tokens))
    for worker in workers:
        worker.run_until(math.inf, ttfts)
    return ttfts


@dataclass
class _Worker:
    """One simulated worker: a queue of [tokens left, arrival (None: the backlog, not timed)]."""

    per_token: float
    fixed: float
    chunk: int
    backlog: float  # prefill tokens queued at the start
    free_at: float = 0.0  # when its step under way ends
    done_at: float = 0.0  # when all it holds would be done: what placement compares
    queue: deque = field(default_factory=deque)

    def __post_init__(self) -> None:
        if self.backlog > 0:
            self.queue.append([self.backlog, None])
            self.done_at = self._cost(self.backlog)

    def _cost(self, tokens: float) -> float:
        return self.per_token * tokens + self.fixed * math.ceil(tokens / self.chunk)

    def add(self, t: float, tokens: int) -> None:
        if not self.queue:
            self.free_at = max(self.free_at, t)
        self.queue.append([tokens, t])
        self.done_at = max(self.done_at, t) + self._cost(tokens)

    def run_until(self, t: float, ttfts: list[float]) -> None:
        """Run the steps that start before t; a request whose last token a step computes is timed then."""
        while self.queue and self.free_at <= t:
            budget, done = self.chunk, []
            for request in self.queue:
                take = min(budget, request[0])
                request[0] -= take
                budget -= take
                if request[0] <= 0:
                    done.append(request)
                if budget <= 0:
                    break
            self.free_at += self.per_token * (self.chunk - budget) + self.fixed
            for request in done:
                self.queue.popleft()
                if request[1] is not None:
                    ttfts.append(self.free_at - request[1])
