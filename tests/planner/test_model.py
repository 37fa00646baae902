"""The pool model against what it stands for: queueing figures known in closed form, chunked prefill
steps simulated apart from the model with the router's least-work placement, and the decode fixed point
it solves."""

import math
import random
from collections import deque

import pytest

from dynamo_pd.planner.model import Costs, Limits, Load, PoolModel, State

LIMITS = Limits(max_num_seqs=64, kv_blocks=20_000, block_size=16, chunk_tokens=2048)
PER_TOKEN = 25e-6  # s: a 3000-token prompt in 75 ms, the mocker's 8B model on an H100


def prefill_model(rate: float, prompts: tuple[int, ...], queued: int = 0, horizon_s: float = 10.0,
                  limits: Limits = LIMITS) -> PoolModel:
    load = Load(rate=rate, prompt_tokens=prompts)
    return PoolModel(Costs(PER_TOKEN), load, State(queued_prefill_tokens=queued), limits, prefills=True,
                     decodes=False, horizon_s=horizon_s, attainment=0.9)


def decode_model(rate: float, output_tokens: float = 150, running: int = 0, costs: Costs | None = None,
                 limits: Limits = LIMITS) -> PoolModel:
    load = Load(rate=rate, prompt_tokens=(0,), prompt_blocks=188,
                output_tokens=output_tokens)
    return PoolModel(costs or Costs(0.0, 6.6e-3, 0.8e-6), load, State(running=running), limits,
                     prefills=False, decodes=True, horizon_s=10.0, attainment=0.95)


def test_idle_pool_ttft_is_the_prefill():
    model = prefill_model(0.0, (3000,))
    assert model.ttft_p50(1) == pytest.approx(3000 * PER_TOKEN, rel=1e-3)
    assert model.ttft_attainment(1, 0.074) == 0.0 and model.ttft_attainment(1, 0.076) == 1.0


def test_queued_prefill_is_computed_first():
    # nothing else arriving: 6000 queued tokens, then the prompt's 3000, in steps of 2048 tokens
    assert prefill_model(0.0, (3000,), queued=6000).ttft_p50(1) == pytest.approx(9000 * PER_TOKEN)
    assert prefill_model(0.0, (3000,), queued=6000).ttft_p50(2) == pytest.approx(6000 * PER_TOKEN)
    quiet, queued = prefill_model(2.0, (3000,)), prefill_model(2.0, (3000,), queued=60_000)
    assert queued.ttft_attainment(1, 0.2) < quiet.ttft_attainment(1, 0.2) - 0.1  # 1.5 s of it: the first wait
    assert queued.ttft_attainment(2, 0.2) > queued.ttft_attainment(1, 0.2)


def test_one_prompt_a_step_is_m_d_1():
    # a step of exactly one prompt: the first come is served first, whole (M/D/1): P(wait) = rho, and the
    # mean wait rho * S / (2 * (1 - rho)) (Pollaczek-Khinchine)
    model = prefill_model(8.0, (3000,), horizon_s=500.0, limits=Limits(64, 20_000, 16, chunk_tokens=3000))
    service, rho = 3000 * PER_TOKEN, 8.0 * 3000 * PER_TOKEN
    assert model.ttft_attainment(1, service * 1.001) == pytest.approx(1 - rho, abs=0.03)
    ttfts = model._ttfts(1)
    assert sum(ttfts) / len(ttfts) - service == pytest.approx(rho * service / (2 * (1 - rho)), rel=0.15)


def simulate(rate: float, prompts: list[int], workers: int, chunk: int, n: int, seed: int = 1) -> list[float]:
    """TTFTs of Poisson arrivals, each prompt placed on the worker whose queued work ends first (the
    router's `time` policy); then each worker's queue run on its own, chunk tokens a step in order, a
    prompt's first token at the end of the step computing its last token."""
    rng = random.Random(seed)
    done_at, queues, t = [0.0] * workers, [[] for _ in range(workers)], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        tokens = rng.choice(prompts)
        w = min(range(workers), key=done_at.__getitem__)
        done_at[w] = max(done_at[w], t) + tokens * PER_TOKEN
        queues[w].append((t, tokens))
    ttfts = []
    for arrivals in queues:
        arrivals, queue, clock = deque(arrivals), deque(), 0.0
        while arrivals or queue:
            if not queue:
                clock = max(clock, arrivals[0][0])
            while arrivals and arrivals[0][0] <= clock:
                arrived, tokens = arrivals.popleft()
                queue.append([tokens, arrived])
            budget, finished = chunk, 0
            for request in queue:
                take = min(budget, request[0])
                request[0], budget = request[0] - take, budget - take
                finished += request[0] == 0
                if not budget:
                    break
            clock += (chunk - budget) * PER_TOKEN
            for _ in range(finished):
                ttfts.append(clock - queue.popleft()[1])
    return ttfts


@pytest.mark.parametrize("rate, prompts, workers", [
    (6.0, [3000], 1),  # rho 0.45: a prompt arriving while one is computed delays its last step
    (10.0, [3000], 1),  # rho 0.75
    (22.0, [3000], 2),  # rho 0.83 over 2
    (40.0, [1000, 2000, 3000, 6000], 4),  # rho 0.75, varied prompts
])
def test_ttft_matches_simulated_chunked_steps(rate, prompts, workers):
    measured = sorted(simulate(rate, prompts, workers, LIMITS.chunk_tokens, n=100_000))
    model = prefill_model(rate, tuple(prompts), horizon_s=200.0)
    p50 = measured[len(measured) // 2]
    # the model's few thousand requests: its median within ~10% of a long run's (varied prompts near rho 1)
    assert model.ttft_p50(workers) == pytest.approx(p50, rel=0.12)
    for slo in (p50 * 1.01, measured[int(len(measured) * 0.9)] * 1.01):  # off the equal TTFTs of equal prompts
        share = sum(x <= slo for x in measured) / len(measured)
        assert model.ttft_attainment(workers, slo) == pytest.approx(share, abs=0.05)


def test_chunking_delays_more_than_rho_of_the_requests():
    # one worker at rho 0.45: first come, first served whole, under half would wait (the median none); in
    # steps of 2048 tokens the next prompt shares the step that ends the one before it
    model = prefill_model(6.0, (3000,))
    assert model.ttft_p50(1) > 3000 * PER_TOKEN * 1.2


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
