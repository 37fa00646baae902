"""router.approx: a worker without KV events gets the cache its placements predict, for a time."""

from __future__ import annotations

from router.approx import ApproxCache, ApproxKvRouter
from router.hashing import block_hashes
from router.service import RouterConfig


def test_blocks_expire_ttl_after_their_last_use_and_the_oldest_go_past_the_bound():
    cache = ApproxCache(ttl_s=10, max_blocks=4)
    assert cache.routed("w", [1, 2, 3], now=0) == []
    assert cache.routed("w", [1, 4], now=5) == []  # 1 used again: lives until 15
    assert cache.expire(now=10) == {"w": [2, 3]}
    assert cache.routed("w", [5, 6, 7], now=11) == [1]  # over 4 blocks: the least recently used goes
    assert cache.blocks_of("w") == 4 and cache.expire(now=100) == {"w": [4, 5, 6, 7]}


def test_the_router_predicts_an_approximate_workers_cache_from_its_placements():
    now = [0.0]
    router = ApproxKvRouter(RouterConfig(block_size=4), approximate=lambda w: w.startswith("http"), ttl_s=30,
                            clock=lambda: now[0])
    for worker in ("http-0", "http-1", "native-0"):
        router.add_worker(worker, "aggregated", capacity_blocks=100)
    prompt = list(range(20))
    placement = router.place("r1", prompt, exclude={"native-0"})  # a tie broken at random: keep it on an http one
    first = placement.decode.worker_id
    placement.finished()
    assert router.indexed_blocks(first) == 5 == router.approx.blocks_of(first)
    again = router.place("r2", prompt)
    assert again.decode.worker_id == first and again.decode.overlap_blocks == 5  # the predicted prefix
    again.finished()
    assert router.indexer.find_matches(block_hashes(prompt, 4)).to_dict() == {first: 5}

    now[0] = 31.0  # the prediction lapses with no use
    router.place("r3", [99] * 8).finished()  # any routing expires what lapsed
    assert router.indexer.find_matches(block_hashes(prompt, 4)).to_dict().get(first, 0) == 0
    router.remove_worker(first)
    assert router.approx.blocks_of(first) == 0


def test_workers_with_kv_events_are_not_predicted():
    router = ApproxKvRouter(RouterConfig(block_size=4), approximate=lambda w: False)
    router.add_worker("native-0", "aggregated", capacity_blocks=100)
    router.place("r1", list(range(16))).finished()
    assert router.indexed_blocks("native-0") == 0 and router.approx.blocks_of("native-0") == 0
