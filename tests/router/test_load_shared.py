"""A prefix several in-flight requests share is held once in a worker's KV (its engine's prefix cache), so the
router's predicted blocks count it once (router/load.py): a burst of prompts over a few shared prefixes does
not read as a full fleet and get refused."""

from router.load import LoadKey, LoadTracker
from router.service import KvRouter, RouterConfig
from router.worker import LoadMetrics, Role
from tests.router.test_load_decay import Clock


def test_blocks_two_placements_share_count_once_until_both_finish():
    tracker = LoadTracker(clock=Clock())
    tracker.add_worker("w", 100)
    prefix = list(range(10))
    a, b = LoadKey("a", Role.AGGREGATED), LoadKey("b", Role.AGGREGATED)
    tracker.place(a, "w", prefill_tokens=0, blocks=12, hashes=prefix + [100])
    assert tracker.load("w").blocks == 12
    tracker.place(b, "w", prefill_tokens=0, blocks=12, hashes=prefix + [200])  # 11 hashed, one partial block
    assert tracker.load("w").blocks == 14
    tracker.finish(a)
    assert tracker.load("w").blocks == 12  # b still holds the prefix
    tracker.finish(b)
    assert tracker.load("w").blocks == 0


def test_a_burst_over_shared_prefixes_is_placed_not_refused():
    """As the kv_tiers benchmark's opening burst: 160 prompts of 4 prefixes of 256 blocks and 8 blocks of
    their own, at once on 16 idle workers of 2,048 blocks. Counted whole (264 blocks each) 8 prompts filled a
    worker past busy_kv_fraction, and from the 129th on the router refused them (Overloaded)."""
    block_size, clock = 16, Clock()
    router = KvRouter(RouterConfig(block_size=block_size, seed=0))
    router.load = LoadTracker(clock=clock)
    for i in range(16):
        router.add_worker(f"w{i}", "aggregated", 2048)
        router.update_load_metrics(LoadMetrics(
            worker_id=f"w{i}", num_running=0, num_waiting=0, num_free_blocks=2048, num_total_blocks=2048,
            prefill_s_per_token=3e-5, decode_s=7e-3, decode_s_per_block=1e-6, output_tokens=64))
    clock.now += 0.5
    prefixes = [[p * 100_000 + t for t in range(256 * block_size)] for p in range(4)]
    for n in range(160):
        router.place(f"r{n}", prefixes[n % 4] + [10_000_000 + n * 1000 + t for t in range(8 * block_size)])
    for i in range(16):
        held = router.load.load(f"w{i}").blocks
        assert held <= 4 * 256 + 160 * 8  # at most every prefix once, and the requests' own blocks
