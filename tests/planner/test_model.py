"""The pool model against what it stands for: queueing figures known in closed form, a simulated
M/G/n queue with the router's least-work placement, and the decode fixed point it solves."""

import heapq
import math
import random

import pytest

from dynamo_pd.planner.model import Costs, Limits, Load, PoolModel, State, backlog_wait, erlang_c

LIMITS = Limits(max_num_seqs=64, kv_blocks=20_000, block_size=16, chunk_tokens=2048)
PER_TOKEN = 25e-6  # s: a 3000-token prompt in 75 ms, the mocker's 8B model on an H100


def prefill_model(rate: float, prompts: tuple[int, ...], queued: int = 0, horizon_s: float = 10.0
                  ) -> PoolModel:
    load = Load(rate=rate, prompt_tokens=prompts)
    return PoolModel(Costs(PER_TOKEN), load, State(queued_prefill_tokens=queued), LIMITS, prefills=True,
                     decodes=False, horizon_s=horizon_s, attainment=0.9)


def decode_model(rate: float, output_tokens: float = 150, running: int = 0, costs: Costs | None = None,
                 limits: Limits = LIMITS) -> PoolModel:
    load = Load(rate=rate, prompt_tokens=(0,), prompt_blocks=188,
                output_tokens=output_tokens)
    return PoolModel(costs or Costs(0.0, 6.6e-3, 0.8e-6), load, State(running=running), limits,
                     prefills=False, decodes=True, horizon_s=10.0, attainment=0.95)


def test_erlang_c_closed_forms():
    assert erlang_c(1, 0.7) == pytest.approx(0.7)  # M/M/1: a request waits with probability rho
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)  # (a^n/n! * n/(n-a)) / (1 + a + that)
    assert erlang_c(10, 0.01) < 1e-12 and erlang_c(10, 9.99) > 0.99


def test_backlog_wait():
    assert backlog_wait(0.0, 0.5, 10.0) == 0.0
    # 1 s of work draining at 0.5 s/s is gone after 2 s of a 10 s horizon: mean 1 * 2 / 2 / 10
    assert backlog_wait(1.0, 0.5, 10.0) == pytest.approx(0.1)
    assert backlog_wait(10.0, 0.5, 10.0) == pytest.approx(7.5)  # still 5 s queued at the horizon
    assert backlog_wait(1.0, 1.2, 10.0) == pytest.approx(2.0)  # growing by 0.2 s/s: 1 -> 3


def test_idle_pool_ttft_is_the_prefill():
    model = prefill_model(0.0, (3000,))
    assert model.ttft_p50(1) == pytest.approx(3000 * PER_TOKEN, rel=1e-3)
    assert model.ttft_attainment(1, 0.074) == 0.0 and model.ttft_attainment(1, 0.076) == 1.0


def test_queued_prefill_adds_to_the_wait():
    quiet, queued = prefill_model(2.0, (3000,)), prefill_model(2.0, (3000,), queued=60_000)
    # 1.5 s of queued work on one worker drains at 1 - rho = 0.85 s/s: 1.5^2 / (2 * 0.85 * 10) on average
    assert queued.ttft_p50(1) - quiet.ttft_p50(1) == pytest.approx(1.5 ** 2 / (2 * 0.85 * 10), rel=0.05)
    assert queued.ttft_p50(2) < queued.ttft_p50(1)  # a second worker halves the backlog each holds


def simulate(rate: float, prompts: list[int], workers: int, n: int = 40_000, seed: int = 1) -> list[float]:
    """TTFTs of Poisson arrivals, each prompt placed on the worker whose queued work ends first (the
    router's `time` policy), served in order: an M/G/n queue."""
    rng = random.Random(seed)
    free = [0.0] * workers  # when each worker's queue empties
    heapq.heapify(free)
    t, ttfts = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        service = rng.choice(prompts) * PER_TOKEN
        start = max(t, heapq.heappop(free))
        heapq.heappush(free, start + service)
        ttfts.append(start + service - t)
    return ttfts[n // 10:]  # past the warm-up


@pytest.mark.parametrize("rate, prompts, workers", [
    (10.0, [3000], 1),  # rho 0.75, deterministic service
    (22.0, [3000], 2),  # rho 0.83 over 2
    (40.0, [1000, 2000, 3000, 6000], 4),  # rho 0.75, varied prompts
])
def test_ttft_matches_a_simulated_queue(rate, prompts, workers):
    measured = sorted(simulate(rate, prompts, workers))
    model = prefill_model(rate, tuple(prompts))
    p50 = measured[len(measured) // 2]
    assert model.ttft_p50(workers) == pytest.approx(p50, rel=0.25)
    for slo in (p50, measured[int(len(measured) * 0.9)]):
        share = sum(x <= slo for x in measured) / len(measured)
        assert model.ttft_attainment(workers, slo) == pytest.approx(share, abs=0.08)


def test_past_capacity_nothing_is_within_the_slo():
    model = prefill_model(14.0, (3000,))  # 1.05 s of prefill a second on one worker
    assert model.ttft_attainment(1, 100.0) == 0.0 and math.isinf(model.ttft_p50(1))
    assert model.ttft_attainment(2, 0.5) > 0.9


def test_decode_itl_is_its_fixed_point():
    blocks = 188 + 150 / 2 / 16  # the prompt's, and half the output's on average
    for n in (1, 2, 4):
        itl = 6.6e-3 / (1 - 0.8e-6 * blocks * 20.0 * 150 / n)  # ITL = d0 + d1 * blocks * (20 * 150 * ITL / n)
        settled = decode_model(20.0, running=round(20.0 * 150 * itl))  # as many running as Little's law says
        assert settled.itl(n)[0] == pytest.approx(itl, rel=0.01)
        assert decode_model(20.0).itl(n)[0] < itl  # from none running, the next interval is lighter
    assert decode_model(0.0).itl(1) == (pytest.approx(6.6e-3), pytest.approx(6.6e-3))


def test_decode_quantile_and_limits():
    model = decode_model(20.0)
    mean, high = model.itl(2)
    assert high > mean  # a worker holds more than the mean at the quantile
    # 20 req/s of 150 tokens at ~8 ms: ~24 in flight, past a worker allowed 16 sequences
    assert math.isinf(decode_model(20.0, limits=Limits(16, 20_000, 16, 2048)).itl(1)[0])
    assert math.isinf(decode_model(20.0, limits=Limits(64, 2_000, 16, 2048)).itl(1)[0])  # KV blocks
    assert math.isinf(decode_model(500.0, costs=Costs(0.0, 6.6e-3, 50e-6)).itl(1)[0])  # step cost outgrows


def test_requests_running_now_weigh_on_the_next_interval():
    calm, busy = decode_model(2.0), decode_model(2.0, running=40)
    assert busy.itl(1)[0] > calm.itl(1)[0]
    assert busy.itl(4)[0] < busy.itl(1)[0]


def test_aggregated_prefill_slows_decode_and_decode_slows_prefill():
    costs = Costs(PER_TOKEN, 6.6e-3, 0.8e-6)
    load = Load(rate=6.0, prompt_tokens=(3000,), prompt_blocks=188,
                output_tokens=150)
    both = PoolModel(costs, load, State(), LIMITS, prefills=True, decodes=True, horizon_s=10.0,
                     attainment=0.9)
    alone = prefill_model(6.0, (3000,))
    # a prompt's chunks ride decode steps: longer than on a prefill worker
    assert both.ttft_p50(2) > alone.ttft_p50(2)
    # prefill tokens in the steps: a share of each step goes to them
    assert both.itl(2)[0] > decode_model(6.0, costs=costs).itl(2)[0]
