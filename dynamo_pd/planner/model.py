"""What a pool of n workers would give the next interval's load: predicted TTFT and ITL.

TTFT (prefill and aggregated pools): a request waits for the prefill queued ahead of it, then is computed.
  service   S_i = c * L_i + s0     L_i: its uncached prompt tokens; c: seconds per prefill token (for an
                                   aggregated worker c + (d0 + d1 * B) / chunk: every chunk of the prompt
                                   rides a step that also decodes); s0: one step's fixed cost (0 where c
                                   carries it already, as a prefill worker's does)
  backlog   b = queued prefill tokens * c / n, now; it drains at 1 - rho (rho = lambda * mean S / n), so
            its mean over the next interval (horizon T) is what a request arriving then waits on top
  wait      M/G/n (the router sends each prompt to the worker with the least queued work): P(wait) is
            Erlang C of the offered load a = lambda * mean S, and a wait is exponential with mean
            (1 + scv) / 2 * mean S / (n - a) (Allen-Cunneen; scv: the squared variation of S)
  so the share of requests with TTFT <= slo is mean_i P(backlog + S_i + wait <= slo), over the prompts
  seen recently, and the predicted p50 is where that share is one half.
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

import math
from dataclasses import dataclass
from functools import cached_property
from statistics import NormalDist

_KV_HEADROOM = 0.95  # past this share of its KV blocks a worker preempts: the ITL model no longer holds


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


def erlang_c(n: int, a: float) -> float:
    """The probability that a request waits in M/M/n at offered load a (in servers), a < n."""
    b = 1.0  # Erlang B, by its recursion: stable for any n
    for k in range(1, n + 1):
        b = a * b / (k + a * b)
    return n * b / (n - a * (1.0 - b))


def backlog_wait(backlog_s: float, rho: float, horizon_s: float) -> float:
    """Mean over [0, horizon] of a per-worker backlog that starts at `backlog_s` and drains at 1 - rho."""
    if backlog_s <= 0:
        return 0.0
    drain = 1.0 - rho
    if drain <= 0 or backlog_s >= drain * horizon_s:  # still queued (or growing) at the horizon
        return backlog_s - drain * horizon_s / 2
    return backlog_s * backlog_s / (2 * drain * horizon_s)


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
        step = c.decode_s + c.decode_s_per_block * self._blocks_per_request() * held
        return c.prefill_s_per_token + step / self.limits.chunk_tokens, step

    def _ttft_terms(self, n: int) -> tuple[list[float], float, float, float] | None:
        """(service times, backlog wait, P(wait), mean wait when waiting), None past the pool's capacity."""
        per_token, fixed = self._service(n)
        load = self.load
        services = [per_token * tokens + fixed for tokens in load.prompt_tokens or (0,)]
        mean = sum(services) / len(services)
        a = load.rate * mean
        if a >= n:
            return None
        backlog = backlog_wait(self.state.queued_prefill_tokens * per_token / n, a / n, self.horizon_s)
        if mean <= 0 or a <= 0:
            return services, backlog, 0.0, 0.0
        scv = sum((s - mean) ** 2 for s in services) / len(services) / (mean * mean)
        return services, backlog, erlang_c(n, a), (1 + scv) / 2 * mean / (n - a)

    def ttft_attainment(self, n: int, slo_s: float) -> float:
        """The share of requests predicted to see TTFT <= slo_s with n workers."""
        terms = self._ttft_terms(n)
        return 0.0 if terms is None else _within(terms, slo_s - (self.offsets.ttft_p50 or 0.0))

    def ttft_p50(self, n: int) -> float:
        """The predicted median TTFT with n workers (inf past the pool's capacity)."""
        terms = self._ttft_terms(n)
        if terms is None:
            return math.inf
        services, backlog, _, _ = terms
        low, high = 0.0, backlog + max(services) + 1.0
        while _within(terms, high) < 0.5:
            high *= 2
        for _ in range(40):  # bisection to well under a millisecond
            mid = (low + high) / 2
            low, high = (mid, high) if _within(terms, mid) < 0.5 else (low, mid)
        return high + (self.offsets.ttft_p50 or 0.0)

    def utilization(self, n: int) -> float:
        per_token, fixed = self._service(n)
        return self.load.rate * (per_token * self.load.mean_prompt_tokens + fixed) / n

    def predict(self, n: int, ttft_slo_s: float) -> Prediction:
        ttft = (self.ttft_p50(n), self.ttft_attainment(n, ttft_slo_s)) if self.prefills else (None, None)
        itl = self.itl(n) if self.decodes else (None, None)
        return Prediction(ttft[0], ttft[1], itl[0], itl[1], self.utilization(n) if self.prefills else 0.0)

    def meets(self, n: int, ttft_slo_s: float, itl_slo_s: float) -> bool:
        if self.prefills and self.ttft_attainment(n, ttft_slo_s) < self.attainment:
            return False
        return not self.decodes or self.itl(n)[1] <= itl_slo_s


def _within(terms: tuple[list[float], float, float, float], t: float) -> float:
    """The share of requests whose modelled TTFT (backlog + service + wait, _ttft_terms) is <= t."""
    services, backlog, waits, theta = terms
    within = 0.0
    for s in services:
        room = t - backlog - s
        if room >= 0:
            within += 1.0 - (waits * math.exp(-room / theta) if theta > 0 else 0.0)
    return within / len(services)
