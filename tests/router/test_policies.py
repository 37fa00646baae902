"""Routing policies, busy thresholds, predicted + corrected load, pools, and the KvRouter facade."""

import math
import time
from collections import Counter

import pytest

from dynamo_pd.protocol import LoadMetrics
from router.hashing import block_hashes
from router.load import ARRIVAL_S, WorkerLoad
from router.policies import (
    CacheAwarePolicy,
    Candidate,
    KvAwarePolicy,
    LeastLoadedPolicy,
    RandomPolicy,
    RoundRobinPolicy,
    RouteRequest,
)
from router.service import KvRouter, NoWorkers, Overloaded, RouterConfig

BS = 16
PROMPT = list(range(10_000, 10_000 + 8 * BS))  # 8 blocks


def make_router(n=4, policy="kv", **kw) -> KvRouter:
    router = KvRouter(RouterConfig(block_size=BS, policy=policy, seed=7, **kw))
    for i in range(n):
        router.add_worker(f"w{i}", "prefill", capacity_blocks=100)
    return router


def metrics(worker, used_blocks, total=100, running=0, prefill=0):
    return LoadMetrics(
        worker_id=worker,
        num_running=running,
        num_waiting=0,
        num_free_blocks=total - used_blocks,
        num_total_blocks=total,
        active_prefill_tokens=prefill,
    )


def test_repeated_prefix_goes_to_its_holder_unless_it_is_busy():
    router = make_router()
    router.indexer.store("w2", block_hashes(PROMPT, BS))
    decision = router.route("prefill", "r1", PROMPT + [1, 2, 3])
    assert (decision.worker_id, decision.overlap_blocks, decision.cached_tokens) == ("w2", 8, 128)
    router.mark_finished("r1")
    router.update_load_metrics(metrics("w2", used_blocks=95))  # at the 95% busy threshold
    assert router.route("prefill", "r2", PROMPT).worker_id != "w2"
    for w in ("w0", "w1", "w3"):
        router.update_load_metrics(metrics(w, used_blocks=99))
    with pytest.raises(Overloaded, match="all 4 prefill workers are busy"):
        router.route("prefill", "r3", PROMPT)


def test_busy_prefill_token_threshold():
    router = make_router(n=2, busy_prefill_tokens=100)
    router.indexer.store("w0", block_hashes(PROMPT, BS))
    router.update_load_metrics(metrics("w0", used_blocks=0, prefill=100))
    assert router.route("prefill", "r", PROMPT).worker_id == "w1"


def test_dynamo_cost():
    policy = KvAwarePolicy(overlap_weight=2.0)
    request = RouteRequest(prompt_tokens=100, block_size=10)
    c = Candidate(
        overlap_blocks=3,
        load=WorkerLoad("w", prefill_tokens=50, blocks=7, requests=1, capacity_blocks=99),
        cached_blocks=0,
    )
    # prefill_blocks = (50 + 100 - 30) / 10 = 12; decode_blocks = 7 + 10 = 17
    assert policy.logit(c, request) == 2.0 * 12 + 17


def candidates(specs):
    return [
        Candidate(overlap, WorkerLoad(f"w{i}", prefill, blocks, requests, 100), cached)
        for i, (overlap, prefill, blocks, requests, cached) in enumerate(specs)
    ]


def test_temperature_sampling_follows_the_softmax():
    request = RouteRequest(prompt_tokens=8 * BS, block_size=BS)
    cands = candidates([(8, 0, 0, 0, 0), (4, 0, 10, 0, 0), (0, 64, 4, 0, 0), (2, 0, 30, 0, 0)])
    temperature = 0.4
    policy = KvAwarePolicy(temperature=temperature, seed=1)
    # independent expectation from the definition
    logits = [
        (c.load.prefill_tokens + 8 * BS - c.overlap_blocks * BS) / BS + c.load.blocks + 8 for c in cands
    ]
    low, spread = min(logits), max(logits) - min(logits)
    weights = [math.exp(-(x - low) / spread / temperature) for x in logits]
    expected = [w / sum(weights) for w in weights]
    assert policy.probabilities(cands, request) == pytest.approx(expected)
    n = 20_000
    counts = Counter(policy.choose(cands, request).worker_id for _ in range(n))
    for i, p in enumerate(expected):
        sigma = math.sqrt(n * p * (1 - p))
        assert abs(counts[f"w{i}"] - n * p) < 5 * sigma, (i, counts, expected)
    # chi-square with 3 degrees of freedom: 16.27 is the 0.999 quantile
    chi2 = sum((counts[f"w{i}"] - n * p) ** 2 / (n * p) for i, p in enumerate(expected))
    assert chi2 < 16.27


def test_temperature_zero_takes_the_minimum_and_breaks_ties_at_random():
    request = RouteRequest(prompt_tokens=4 * BS, block_size=BS)
    cands = candidates([(2, 0, 0, 0, 0), (2, 0, 0, 0, 0), (0, 0, 0, 0, 0)])
    policy = KvAwarePolicy(seed=3)
    picks = Counter(policy.choose(cands, request).worker_id for _ in range(400))
    assert set(picks) == {"w0", "w1"} and min(picks.values()) > 120


def test_baselines():
    request = RouteRequest(prompt_tokens=4 * BS, block_size=BS)
    cands = candidates([(0, 0, 5, 3, 10), (4, 0, 1, 1, 50), (1, 0, 9, 1, 2)])
    rr = RoundRobinPolicy()
    assert [rr.choose(cands, request).worker_id for _ in range(4)] == ["w0", "w1", "w2", "w0"]
    assert {RandomPolicy(seed=s).choose(cands, request).worker_id for s in range(30)} == {"w0", "w1", "w2"}
    assert LeastLoadedPolicy().choose(cands, request).worker_id == "w1"  # fewest requests, then blocks


def test_cache_aware_policy_as_sglang():
    policy = CacheAwarePolicy(cache_threshold=0.5, balance_abs_threshold=4, balance_rel_threshold=1.5, seed=0)
    request = RouteRequest(prompt_tokens=4 * BS, block_size=BS)
    # balanced, best match 3/4 > 0.5: the longest match
    assert policy.choose(candidates([(3, 0, 0, 2, 50), (1, 0, 0, 2, 5)]), request).worker_id == "w0"
    # balanced, best match 1/4 <= 0.5: the smallest cache
    assert policy.choose(candidates([(1, 0, 0, 2, 50), (0, 0, 0, 2, 5)]), request).worker_id == "w1"
    # imbalanced (10 - 2 > 4 and 10 > 1.5 * 2): the least loaded, whatever the cache says
    assert policy.choose(candidates([(4, 0, 0, 10, 50), (0, 0, 0, 2, 5)]), request).worker_id == "w1"
    with pytest.raises(ValueError, match="cache_threshold must be in"):
        CacheAwarePolicy(cache_threshold=2)


@pytest.mark.parametrize("policy", ["round_robin", "random", "least_loaded", "cache_aware"])
def test_every_policy_serves_through_the_facade(policy):
    """One workload for every policy: 12 requests of a prompt whose blocks w1 holds, none finished."""
    router = make_router(n=3, policy=policy)
    router.indexer.store("w1", block_hashes(PROMPT, BS))
    chosen = [router.route("prefill", f"r{i}", PROMPT).worker_id for i in range(12)]
    if policy == "round_robin":  # blind to cache and load
        assert chosen == ["w0", "w1", "w2"] * 4
    elif policy == "least_loaded":  # each placement adds to its worker's load
        assert Counter(chosen) == {"w0": 4, "w1": 4, "w2": 4}
    elif policy == "random":
        assert set(chosen) == {"w0", "w1", "w2"}
    else:  # the whole prompt cached on w1, and 12 requests stay within the balance thresholds
        assert chosen == ["w1"] * 12


def test_predicted_load_follows_the_request_and_metrics_correct_it():
    router = make_router(n=1)
    router.indexer.store("w0", block_hashes(PROMPT[: 2 * BS], BS))  # 2 of 8 blocks cached
    router.route("prefill", "r1", PROMPT + [7])
    load = router.load.load("w0")
    assert (load.prefill_tokens, load.blocks, load.requests) == (6 * BS + 1, 9, 1)
    router.mark_prefill_done("r1")
    assert router.load.load("w0").prefill_tokens == 0
    # the worker reports more than predicted (requests from elsewhere): the offset stays until the next report
    time.sleep(2 * ARRIVAL_S)  # its counts are taken once r1 reached it (test_load_burst.py: before)
    router.update_load_metrics(metrics("w0", used_blocks=30, running=3))
    assert (router.load.load("w0").blocks, router.load.load("w0").requests) == (30, 3)
    router.route("prefill", "r2", [t + 1000 for t in PROMPT])  # a prompt of its own (a shared one counts once)
    assert router.load.load("w0").blocks == 38  # placed after the report: still counted
    router.mark_finished("r1")
    router.mark_finished("r2")
    assert router.load.load("w0").blocks == 21
    router.update_load_metrics(metrics("w0", used_blocks=0))
    assert router.load.load("w0") == WorkerLoad("w0", 0, 0, 0, 100)
    router.mark_finished("r1")  # twice is harmless


def test_decode_pool_uses_load_and_overlap_only_when_it_prefills_locally():
    router = KvRouter(RouterConfig(block_size=BS, seed=1))
    router.add_worker("p0", "prefill", 100)
    router.add_worker("d0", "decode", 100)
    router.add_worker("d1", "decode", 100)
    router.indexer.store("d1", block_hashes(PROMPT, BS))
    router.update_load_metrics(metrics("d1", used_blocks=10))
    remote = router.route("decode", "r1", PROMPT)
    assert (remote.worker_id, remote.overlap_blocks) == ("d0", 0)  # d1 is busier; its cache does not matter
    assert router.load.load("d0").prefill_tokens == 0  # KV arrives by transfer
    local = router.route("decode", "r2", PROMPT, local_prefill=True)
    assert (local.worker_id, local.overlap_blocks) == ("d1", 8)
    # one request id, one placement per pool; mark_* reach both unless a pool is named
    router.route("prefill", "r1", PROMPT)
    router.mark_finished("r1", pool="decode")
    assert router.load.load("p0").requests == 1 and router.load.load("d0").requests == 0
    router.mark_finished("r1")
    assert router.load.load("p0").requests == 0


def test_bad_input_gets_clear_errors():
    router = make_router(n=1)
    with pytest.raises(ValueError, match="empty prompt"):
        router.route("prefill", "r", [])
    with pytest.raises(NoWorkers, match="no decode workers"):
        router.route("decode", "r", PROMPT)
    with pytest.raises(NoWorkers, match="unknown pool 'x'"):
        router.route("x", "r", PROMPT)
    with pytest.raises(ValueError, match="unknown pool 'x'"):
        router.add_worker("w9", "x", 10)
    with pytest.raises(ValueError, match="capacity_blocks must be positive"):
        router.add_worker("w9", "decode", 0)
    with pytest.raises(ValueError, match="unknown routing policy 'best'"):
        KvRouter(RouterConfig(policy="best"))
    router.route("prefill", "r", PROMPT)
    with pytest.raises(ValueError, match="already placed"):
        router.route("prefill", "r", PROMPT)
    router.remove_worker("w0")
    with pytest.raises(NoWorkers):
        router.route("prefill", "r2", PROMPT)
