"""The `time` policy: its cost formula by hand, the figures workers measure, and a simulation of two
mocker workers behind a KvRouter where it beats round-robin, least-loaded and Dynamo's cost."""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

import pytest

from dynamo_pd.engines.base import EngineConfig
from dynamo_pd.engines.mocker.profile import Profile, h100_llama8b
from dynamo_pd.engines.native.step_costs import StepCostMeter, StepLoad
from dynamo_pd.protocol import EngineRequest, LoadMetrics, SamplingParams, StopConditions
from router.hashing import block_hashes
from router.load import LoadTracker, StepCosts, WorkerLoad
from router.policies import PRIOR, Candidate, KvAwarePolicy, RouteRequest, TimePolicy
from router.service import KvRouter, RouterConfig

BS = 16


def candidate(overlap=0, prefill=0, blocks=0, requests=0, costs=StepCosts(), name="w"):
    return Candidate(overlap, WorkerLoad(name, prefill, blocks, requests, 1000), 0, costs)


def test_the_cost_is_the_documented_formula():
    k = StepCosts(prefill_s_per_token=0.01, decode_s=0.1, decode_s_per_block=0.002, output_tokens=4)
    c = candidate(overlap=3, prefill=50, blocks=7, requests=2, costs=k)
    request = RouteRequest(prompt_tokens=100, block_size=10)  # 10 blocks, 70 tokens uncached
    own = 0.01 * (50 + 70) + 4 * (0.1 + 0.002 * (7 + 10))  # 1.2 + 0.536
    others = 2 * (0.01 * 70 + 4 * 0.002 * 10)  # 2 * 0.78
    assert sum(TimePolicy.split_cost(c, k, request)) == pytest.approx(own + others) == pytest.approx(3.296)
    # a decode worker fed by a KV transfer prefills nothing of it
    remote = RouteRequest(prompt_tokens=100, block_size=10, prefill=False)
    assert sum(TimePolicy.split_cost(c, k, remote)) == pytest.approx(0.01 * 50 + 0.536 + 2 * 0.08)


def test_every_candidate_is_costed_with_the_pools_median_figures_else_the_prior():
    reported = [StepCosts(0.01, 0.1, 0.001, 8.0), StepCosts(0.03, None, None, 4.0), StepCosts()]
    pool = TimePolicy.pool_costs([candidate(costs=k, name=f"w{i}") for i, k in enumerate(reported)])
    assert pool == StepCosts(0.02, 0.1, 0.001, 6.0)
    assert TimePolicy.pool_costs([candidate(), candidate(name="w1")]) == PRIOR


def test_the_worker_with_the_prefix_wins_whatever_each_happened_to_measure():
    """What 16 identical mocker workers reported serving multi-turn chat: the one holding the session's
    prefix had measured 0.09 ms a prefill token and 64-token outputs, an idle one 0.015 ms and 32 tokens (it
    had served health canaries). Costed with its own figures the idle one looked 330 ms cheaper and won."""
    request = RouteRequest(prompt_tokens=570, block_size=BS)  # 36 blocks, 23 of them on w0
    holder = candidate(23, costs=StepCosts(9e-5, 13.2e-3, 1e-5, 64.0), name="w0")
    idle = candidate(0, costs=StepCosts(1.5e-5, 13.2e-3, 1e-5, 32.0), name="w1")
    assert TimePolicy().choose([holder, idle], request).worker_id == "w0"
    own = [sum(TimePolicy.split_cost(c, c.costs, request)) for c in (holder, idle)]
    assert own[1] < own[0] - 0.3  # what each worker's own figures said


def test_the_busier_worker_keeps_its_prefix_while_prefill_costs_more_than_decode():
    """The issue's case: w0 holds the request's 480-token prefix and runs 2 requests (66 blocks), w1
    is idle. Dynamo's cost with weight 1 moves it to w1 and prefills all 528 tokens again there."""
    request = RouteRequest(prompt_tokens=528, block_size=BS)  # 33 blocks
    cpu = StepCosts(prefill_s_per_token=2e-3, decode_s=0.05, decode_s_per_block=6e-5, output_tokens=8)
    busy, idle = candidate(30, 0, 66, 2, cpu, "w0"), candidate(costs=cpu, name="w1")
    # kv: (528 - 480) / 16 + 66 + 33 = 102 > 528 / 16 + 33 = 66
    assert KvAwarePolicy().choose([busy, idle], request).worker_id == "w1"
    # time: w0 0.096 + 8 * (0.05 + 6e-5 * 99) + 2 * (0.096 + 8 * 6e-5 * 33) = 0.767 s
    #       w1 1.056 + 8 * (0.05 + 6e-5 * 33) = 1.472 s
    assert sum(TimePolicy.split_cost(busy, cpu, request)) == pytest.approx(0.7672, abs=1e-4)
    assert sum(TimePolicy.split_cost(idle, cpu, request)) == pytest.approx(1.4718, abs=1e-4)
    assert TimePolicy().choose([busy, idle], request).worker_id == "w0"
    # where long outputs make decode the dear part (64 tokens, 5 ms per block and step) it moves
    heavy = cpu._replace(decode_s_per_block=5e-3, output_tokens=64)
    busy, idle = busy._replace(costs=heavy), idle._replace(costs=heavy)
    assert TimePolicy().choose([busy, idle], request).worker_id == "w1"


def test_reported_costs_reach_the_router_and_old_workers_report_none():
    router = KvRouter(RouterConfig(block_size=BS, policy="time", seed=0))
    for w in ("w0", "w1"):
        router.add_worker(w, "aggregated", 100)
    router.update_load_metrics(LoadMetrics(worker_id="w0", num_running=0, num_waiting=0, num_free_blocks=100,
                                           num_total_blocks=100, prefill_s_per_token=1e-3, decode_s=0.02,
                                           decode_s_per_block=1e-4, output_tokens=12.0))
    router.update_load_metrics(LoadMetrics(worker_id="w1", num_running=0, num_waiting=0, num_free_blocks=100,
                                           num_total_blocks=100))
    assert router.load.costs("w0") == StepCosts(1e-3, 0.02, 1e-4, 12.0)
    assert router.load.costs("w1") == StepCosts()
    # the one that reported dearer steps still gets the prompt it holds (the pool's figures cost both)
    router.update_load_metrics(LoadMetrics(worker_id="w1", num_running=0, num_waiting=0, num_free_blocks=100,
                                           num_total_blocks=100, prefill_s_per_token=2e-3, decode_s=0.02,
                                           decode_s_per_block=1e-4, output_tokens=12.0))
    prompt = list(range(100, 100 + 4 * BS))
    router.indexer.store("w1", block_hashes(prompt, BS))
    assert router.route("aggregated", "r0", prompt).worker_id == "w1"


def test_the_meter_recovers_a_linear_step_model():
    meter = StepCostMeter()
    assert meter.costs() == StepCosts(None, 0.0, 0.0, None)
    rng = random.Random(0)
    for _ in range(2000):  # seconds = 0.05 + 0.001 * B + 0.002 * P, P = 0 for decode-only steps
        load = StepLoad(rng.choice([0, 0, 0, 48, 512]), rng.randrange(0, 400))
        meter.observe(load, 0.05 + 0.001 * load.decode_blocks + 0.002 * load.prefill_tokens)
    for n in (8, 16, 8, 8):
        meter.finished(n)
    costs = meter.costs()
    assert costs[:3] == pytest.approx((0.002, 0.05, 0.001), rel=1e-3)
    assert 8 < costs.output_tokens < 16
    # a prefill worker never runs a decode-only step: a token carries its share of the step overhead
    prefill_only = StepCostMeter()
    for _ in range(100):
        prefill_only.observe(StepLoad(500, 0), 0.05 + 0.002 * 500)
    assert prefill_only.costs()[:3] == pytest.approx((0.0021, 0.0, 0.0))


def linear_profile(step_ms: float, ms_per_token: float) -> Profile:
    """A CPU-like profile, linear so a fitted line is exact: every step costs `step_ms`, and each
    token it computes (prefill token or decode row, whatever its context) `ms_per_token` more."""
    top = 1 << 15
    return Profile(
        name="linear", source="tests/router/test_time_policy.py",
        prefill_tokens=[1, top], prefill_cached=[0, top],
        prefill_ms=[[step_ms + ms_per_token] * 2, [step_ms + ms_per_token * top] * 2],
        decode_batch=[1, 1024], decode_context=[0, top],
        decode_ms=[[step_ms + ms_per_token] * 2, [step_ms + ms_per_token * 1024] * 2],
        kv_bytes_per_token=1, transfer_gb_per_s=1.0)


@dataclass
class Workload:
    prefixes: int = 8
    prefix_tokens: int = 480
    unique_tokens: int = 48
    requests: int = 96
    concurrency: int = 4
    output_tokens: int = 8
    seed: int = 0

    def prompts(self) -> list[list[int]]:
        rng = random.Random(self.seed)
        prefixes = [[rng.randrange(100, 30000) for _ in range(self.prefix_tokens)] for _ in range(self.prefixes)]
        return [rng.choice(prefixes) + [rng.randrange(100, 30000) for _ in range(self.unique_tokens)]
                for _ in range(self.requests)]


def simulate(policy: str, workload: Workload, profile: Profile, num_blocks: int, workers: int = 2,
             **router_config) -> tuple[list[float], dict]:
    """Closed-loop clients on simulated time: each worker (a MockerCore) runs one step at a time and
    its outputs, KV events and load (with its measured costs) reach the router when the step ends.
    Returns every request's TTFT in simulated seconds, and the cores."""
    from dynamo_pd.engines.mocker.core import MockerCore

    cores = {f"w{i}": MockerCore(EngineConfig(num_kv_blocks=num_blocks, block_size=BS), profile)
             for i in range(workers)}
    router = KvRouter(RouterConfig(block_size=BS, policy=policy, seed=workload.seed, **router_config))
    router.load = LoadTracker(clock=lambda: now)  # the simulated time: placements and reports are in it
    for w in cores:
        router.add_worker(w, "aggregated", num_blocks)
    prompts = iter(enumerate(workload.prompts()))
    now, in_flight, sent, ttft = 0.0, 0, {}, {}
    ends: dict[str, tuple[float, list]] = {}  # worker -> (when its running step ends, its outputs)
    while True:
        while in_flight < workload.concurrency and (item := next(prompts, None)) is not None:
            i, prompt = item
            rid = f"r{i}"
            w = router.route("aggregated", rid, prompt).worker_id
            cores[w].add_request(EngineRequest(
                request_id=rid, prompt_token_ids=prompt, sampling=SamplingParams(temperature=0),
                stop=StopConditions(max_tokens=workload.output_tokens, ignore_eos=True)))
            sent[rid], in_flight = now, in_flight + 1
        for w, core in cores.items():
            if w not in ends and core.has_work:
                outputs = core.step()
                assert core.step_s > 0, "every request fits one worker's cache: no step stalls"
                ends[w] = (now + core.step_s, outputs)
        if not ends:
            break
        w = min(ends, key=lambda w: ends[w][0])
        now, outputs = ends.pop(w)
        cores[w].step_taken(cores[w].step_s)  # on simulated time a step takes what the profile says
        for out in outputs:
            if out.request_id not in ttft:
                ttft[out.request_id] = now - sent[out.request_id]
                router.mark_prefill_done(out.request_id)
            if out.finish_reason is not None:
                router.mark_finished(out.request_id)
                in_flight -= 1
        core = cores[w]
        router.ingestor.apply_events(w, core.block_manager.drain_events())
        stats = core.stats()
        router.update_load_metrics(LoadMetrics(
            worker_id=w, num_running=stats.num_running, num_waiting=stats.num_waiting,
            num_free_blocks=stats.num_free_blocks, num_total_blocks=stats.num_total_blocks,
            active_prefill_tokens=stats.num_active_prefill_tokens, counted_s_ago=cores[w].step_s,
            **stats.costs._asdict()))  # its counts: the requests the step began with
    assert len(ttft) == workload.requests
    return list(ttft.values()), cores


CASES = {  # name: (profile, workload, blocks per worker where the 8 prefixes exceed one cache, where they fit)
    "cpu-like": (linear_profile(step_ms=50.0, ms_per_token=2.0), Workload(), (200, 600)),
    "h100-llama8b": (h100_llama8b(), Workload(prefix_tokens=4096, unique_tokens=64), (1400, 4000)),
}
BASELINES = [("round_robin", {}), ("least_loaded", {}), ("kv", {"overlap_weight": 1.0})]


@pytest.mark.slow  # MockerCore reads the served model's tokenizer and config
@pytest.mark.parametrize("case", CASES)
def test_time_policy_has_the_lowest_mean_ttft(case):
    """Two workers, 96 requests of one of 8 shared prefixes + a unique tail, 4 at a time, 8 output
    tokens. Where the prefixes exceed one worker's cache it is ahead of every baseline; where they
    fit, not behind."""
    profile, workload, (exceeds, fits) = CASES[case]
    for blocks in (exceeds, fits):
        mine = statistics.mean(simulate("time", workload, profile, blocks)[0])
        for policy, config in BASELINES:
            theirs = statistics.mean(simulate(policy, workload, profile, blocks, **config)[0])
            assert mine < theirs if blocks == exceeds else mine <= theirs, (blocks, policy, mine, theirs)


@pytest.mark.slow
def test_measured_costs_converge_to_the_mocker_profile():
    """The linear profile: a step costs 50 ms + 2 ms per token computed; a decode row of 529-536
    tokens of context holds 34 blocks, so a decode step costs 50 ms + 2 / 34 ms per block."""
    profile, workload, (blocks, _) = CASES["cpu-like"]
    _, cores = simulate("time", workload, profile, blocks)
    for core in cores.values():
        costs = core.stats().costs
        assert costs.prefill_s_per_token == pytest.approx(2e-3, rel=0.05)
        assert costs.decode_s == pytest.approx(0.05, rel=0.02)
        assert costs.decode_s_per_block == pytest.approx(2e-3 / 34, rel=0.05)
        assert costs.output_tokens == pytest.approx(workload.output_tokens)

