"""The planner benchmarks' sinusoid: Poisson arrivals whose rate follows low .. high req/s, as mooncake_trace
rows. benchmarks.planner replays them through aiperf, benchmarks.planner_dynamo through Dynamo's replay, whose
venv lacks our stack: standard library only."""

from __future__ import annotations

import math
import random


def times(low: float, high: float, period_s: float, periods: int, seed: int) -> list[float]:
    """Arrival times (simulated s) of a Poisson process whose rate follows the sinusoid, by thinning."""
    rng, found, t, end = random.Random(seed), [], 0.0, period_s * periods
    while True:
        t += rng.expovariate(high)
        if t >= end:
            return found
        rate = (low + high) / 2 - (high - low) / 2 * math.cos(2 * math.pi * t / period_s)
        if rng.random() < rate / high:
            found.append(t)


def rows(low: float, high: float, period_s: float, periods: int, isl: int, osl: int, seed: int,
         block_tokens: int, speedup: float = 1.0) -> list[dict]:
    """The sinusoid's mooncake_trace rows, timestamps in ms of real time (simulated / speedup): each prompt's
    first block is its own, so no two share a cached prefix; the rest come from a small pool (aiperf builds
    each block once, at one size: a last block shorter than the others is the prompt's own too)."""
    blocks, partial = math.ceil(isl / block_tokens), int(isl % block_tokens != 0)
    pool = 64
    rng = random.Random(seed)
    return [{"timestamp": round(t * 1e3 / speedup), "input_length": isl, "output_length": osl,
             "hash_ids": [pool + 2 * i, *(rng.randrange(pool) for _ in range(blocks - 1 - partial)),
                          *[pool + 2 * i + 1] * partial]}
            for i, t in enumerate(times(low, high, period_s, periods, seed))]
