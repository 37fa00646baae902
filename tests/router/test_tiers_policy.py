"""Fetch or recompute: the `time` policy's prefix sources (the worker's pool, its lower tiers copied back, a
peer's pool read), timed by the fetch costs workers measure, against the prefill time of computing the same
tokens; no threshold. By hand, through KvRouter with tiered KV events, and for a drained worker's KV."""

from __future__ import annotations

import pytest

from router.events import TIER_DISK, TIER_HOST, BlockStored, encode_batch
from router.hashing import block_hashes
from router.load import FetchCosts, StepCosts, WorkerLoad
from router.policies import FETCH_PRIOR, Candidate, FetchPlan, RouteRequest, TimePolicy, local_plan
from router.service import KvRouter, RouterConfig
from router.worker import LoadMetrics

BS = 16
B = 1_000_000  # bytes of one block's KV
STEPS = StepCosts(prefill_s_per_token=1e-3, decode_s=0.01, decode_s_per_block=1e-4, output_tokens=4)
FETCH = FetchCosts(block_bytes=B, host_bytes_per_s=10e9, host_fixed_s=0.0, disk_bytes_per_s=1e9,
                   disk_fixed_s=0.0, pull_bytes_per_s=2e9, pull_fixed_s=0.01)


def same(plan: FetchPlan, expected: FetchPlan) -> bool:
    return (plan.source, plan.covered_blocks, plan.peer) == (expected.source, expected.covered_blocks, expected.peer) \
        and (plan.fetch_s, plan.onboard_s) == pytest.approx((expected.fetch_s, expected.onboard_s))


def candidate(overlap=0, lower=(), peer=None, peer_blocks=0, requests=0, fetch=FETCH, name="w") -> Candidate:
    return Candidate(overlap, WorkerLoad(name, 0, 0, requests, 10_000), 0, STEPS, tuple(lower), fetch, peer,
                     peer_blocks)


def test_lower_tier_blocks_extend_the_prefix_at_their_tiers_measured_rates():
    c = candidate(overlap=2, lower=(3, 5))  # 3 blocks on the host tier, then 5 on disk
    plan = local_plan(c, FETCH)
    assert same(plan, FetchPlan("tier", 10, 3 * B / 10e9 + 5 * B / 1e9, 3 * B / 10e9 + 5 * B / 1e9))
    request = RouteRequest(prompt_tokens=20 * BS, block_size=BS)
    k = STEPS
    own = k.prefill_s_per_token * 10 * BS + plan.fetch_s + 4 * (0.01 + 1e-4 * 20)
    assert sum(TimePolicy.split_cost(c, k, request, plan)) == pytest.approx(own)
    busy = c._replace(load=WorkerLoad("w", 0, 0, 3, 10_000))  # a copy back holds up the requests there too
    others = 3 * (k.prefill_s_per_token * 10 * BS + plan.onboard_s + 4 * 1e-4 * 20)
    assert sum(TimePolicy.split_cost(busy, k, request, plan)) == pytest.approx(own + others)
    assert local_plan(candidate(overlap=2)) == FetchPlan("device", 2)


def test_a_pull_is_planned_exactly_where_it_is_predicted_sooner_than_computing_what_it_brings():
    request = RouteRequest(prompt_tokens=64 * BS + 1, block_size=BS)
    # a peer holds 64 blocks: computing them takes 64 * 16 * 1 ms = 1.024 s; reading them 0.01 + 64 MB / rate,
    # and the request joins the batch a step (0.01 s, no blocks running) after its read ends
    crossover = 64 * B / (1.024 - 0.01 - 0.01)  # bytes per second at which both take as long
    for rate, source in ((crossover * 1.05, "peer"), (crossover * 0.95, "device")):
        fetch = FETCH._replace(pull_bytes_per_s=rate)
        c = candidate(peer="holder", peer_blocks=64, fetch=fetch)
        chosen, plan = TimePolicy(seed=0).choose_plan([c], request)
        assert plan.source == source, rate
    c = candidate(peer="holder", peer_blocks=64)
    _, plan = TimePolicy(seed=0).choose_plan([c], request)
    assert same(plan, FetchPlan("peer", 64, 0.01 + 64 * B / 2e9, 0.0, "holder"))
    # its tier blocks come first (the engine copies them back anyway); the peer reads only the rest
    c = candidate(overlap=4, lower=(0, 10), peer="holder", peer_blocks=64)
    plans = TimePolicy.plans(c, FETCH, request)
    assert same(plans[1], FetchPlan("peer", 64, 10 * B / 1e9 + 0.01 + 50 * B / 2e9, 10 * B / 1e9, "holder"))
    # a read that saves less than a step is not planned: it holds 1 block past the worker's 4, computed in 16 ms
    # or read in 10.5 ms, then joined a step (10 ms) later (kv_tiers, where the prefixes fit: prompts seen before
    # read their 8-block suffixes from the worker that computed them)
    suffix = candidate(overlap=4, peer="holder", peer_blocks=5)
    assert TimePolicy(seed=0).choose_plan([suffix], RouteRequest(prompt_tokens=5 * BS + 1, block_size=BS))[1] \
        == FetchPlan("device", 4)
    # nor where it only spares the worker's other requests the chunk: priced at p a token they would wait 17 ms
    # each for it, but a small chunk beside their decode costs them far less; that weighs the worker, not the plan
    busy = suffix._replace(load=suffix.load._replace(requests=2))
    assert TimePolicy(seed=0).choose_plan([busy], RouteRequest(prompt_tokens=5 * BS + 1, block_size=BS))[1] \
        == FetchPlan("device", 4)
    # and a read sooner for the request is planned whatever runs there
    c = candidate(peer="holder", peer_blocks=64, requests=2)
    assert TimePolicy(seed=0).choose_plan([c], request)[1].source == "peer"
    # never the prompt's last token: the engine computes at least one
    c = candidate(peer="holder", peer_blocks=65)
    assert TimePolicy.plans(c, FETCH, RouteRequest(prompt_tokens=65 * BS, block_size=BS))[1].covered_blocks == 64


def test_workers_that_measured_nothing_take_the_fleets_median_else_the_prior_and_no_block_size_fetches_nothing():
    measured = candidate(name="a")
    fresh = candidate(name="b", fetch=FetchCosts(block_bytes=B))
    legacy = candidate(name="c", fetch=FetchCosts())  # an engine that reports no fetch costs (vLLM)
    fleet = TimePolicy.fleet_fetch([measured, fresh, legacy])
    assert fleet[0] == FETCH and fleet[1] == FETCH and fleet[2] == FetchCosts()
    assert TimePolicy.fleet_fetch([fresh])[0] == FETCH_PRIOR._replace(block_bytes=B)
    c = legacy._replace(peer="holder", peer_blocks=64)
    assert TimePolicy.plans(c, fleet[2], RouteRequest(64 * BS + 1, BS)) == [FetchPlan("device", 0)]


def stored(hashes, tokens, medium=None, first=0):
    if medium is not None:
        return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=BS, medium=medium)
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=BS)


def router_with(prompt, lends=("w0", "w1", "w2")) -> KvRouter:
    """w0 holds the prompt's 40 blocks in its pool, w1 its first 10 in its pool and 20 more on disk, w2
    nothing; every worker measured the same costs."""
    router = KvRouter(RouterConfig(block_size=BS, seed=0))
    hashes = block_hashes(prompt, BS)
    for w in ("w0", "w1", "w2"):
        router.add_worker(w, "aggregated", 10_000, BS, lends_prefixes=w in lends)
        router.ingestor.trust(w)
        router.update_load_metrics(LoadMetrics(worker_id=w, num_running=0, num_waiting=0, num_free_blocks=10_000,
                                               num_total_blocks=10_000, **STEPS._asdict(), **FETCH._asdict()))
    router.ingestor.deliver("w0", 0, encode_batch([stored(hashes[:40], prompt[:40 * BS])]))
    router.ingestor.deliver("w1", 0, encode_batch([stored(hashes[:10], prompt[:10 * BS]),
                                                   stored(hashes[10:30], [], TIER_DISK)]))
    return router


def test_the_router_places_with_the_prefix_source_and_books_only_what_is_computed():
    prompt = list(range(1000, 1000 + 40 * BS + 5))
    router = router_with(prompt)
    # w0 is loaded (it would compute nothing, but its queue is long): the others fetch instead
    for i in range(20):
        router.route("aggregated", f"filler-{i}", list(range(50_000 + 100 * i, 50_000 + 100 * i + 50)),
                     exclude={"w1", "w2"})
    decision = router.route("aggregated", "r", prompt, exclude={"w0"})
    assert decision.worker_id in ("w1", "w2") and decision.source == "peer" and decision.peer == "w0"
    assert decision.peer_blocks == 40 and decision.cached_tokens == 40 * BS
    # w1 also copies its 20 disk blocks back first; both read w0's pool (cheaper than computing 640 tokens)
    w1 = router.route("aggregated", "r1", prompt, exclude={"w0", "w2"})
    assert (w1.source, w1.overlap_blocks, w1.peer_blocks) == ("peer", 10, 40)
    assert router.load.load("w1").prefill_tokens == 5, "only the tokens it computes are booked"
    # a worker that does not lend its prefixes is no peer, and one that does not read pulls none
    router = router_with(prompt, lends=("w1", "w2"))
    decision = router.route("aggregated", "r", prompt, exclude={"w0", "w1"})
    assert (decision.source, decision.peer, decision.peer_blocks) == ("peer", "w1", 10), "w1's pool, not w0's"
    router = router_with(prompt, lends=("w0",))
    decision = router.route("aggregated", "r", prompt, exclude={"w0"})
    assert decision.source in ("device", "tier") and decision.peer is None


def test_a_tier_only_route_without_peers():
    prompt = list(range(1000, 1000 + 40 * BS + 5))
    router = router_with(prompt, lends=())
    decision = router.route("aggregated", "r", prompt, exclude={"w0", "w2"})
    assert (decision.source, decision.overlap_blocks, decision.cached_tokens) == ("tier", 10, 30 * BS)
    stored_host = stored(block_hashes(prompt, BS)[30:32], [], TIER_HOST)
    router.ingestor.deliver("w1", 1, encode_batch([stored_host]))
    decision = router.route("aggregated", "r2", prompt, exclude={"w0", "w2"})
    assert decision.cached_tokens == 32 * BS


def test_a_drained_workers_kv_is_read_when_that_is_sooner_and_left_when_it_is_not():
    prompt = list(range(1000, 1000 + 40 * BS + 5))
    router = router_with(prompt, lends=("w2",))
    decision = router.route("aggregated", "m", prompt, exclude={"w0", "w1"})
    assert decision.source == "device" and decision.worker_id == "w2"
    moved = router.consider_peer(decision, prompt, None, "drained", 40)
    assert (moved.source, moved.peer, moved.peer_blocks, moved.cached_tokens) == ("peer", "drained", 40, 40 * BS)
    # a slow link (1 MB/s: 40 s to read what takes 0.64 s to compute): recomputed
    router.update_load_metrics(LoadMetrics(worker_id="w2", num_running=0, num_waiting=0, num_free_blocks=10_000,
                                           num_total_blocks=10_000, **STEPS._asdict(),
                                           **FETCH._replace(pull_bytes_per_s=1e6)._asdict()))
    assert router.consider_peer(decision, prompt, None, "drained", 40) == decision
    # a worker that cannot read peers' KV keeps its plan
    router = router_with(prompt, lends=())
    decision = router.route("aggregated", "m", prompt, exclude={"w0", "w1"})
    assert router.consider_peer(decision, prompt, None, "drained", 40) == decision
