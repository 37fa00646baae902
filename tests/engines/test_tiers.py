"""KV tiers below the pool (engines/native/tiers.py): eviction order and the frequency filter, the disk tier's
files (bounded, checksummed, removed at stop), and blocks copied back before a prefill instead of recomputed,
through the engine core the native engine and the mocker share (here the mocker's, whose stand-in KV holds
each computed token's id, so a block served from a tier shows whether its bytes are the right ones)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dynamo_pd.engines.base import EngineConfig
from dynamo_pd.engines.mocker.core import MockerCore
from dynamo_pd.engines.mocker.profile import h100_llama8b
from dynamo_pd.engines.native.tiers import _HEADER, KVTiers, TierConfig
from dynamo_pd.protocol import EngineRequest, SamplingParams, StopConditions
from dynamo_pd.worker_metrics import WorkerEndpoint
from router.events import TIER_DISK, TIER_HOST, BlockRemoved, BlockStored
from router.hashing import block_hashes

PROFILE = h100_llama8b()
BS = 16
PROFILED_BLOCK = PROFILE.kv_bytes_per_token * BS


# ---- KVTiers alone: what goes where, in which order


def tiers_over(tmp_path, host: int, disk: int) -> tuple[KVTiers, torch.Tensor]:
    kv = torch.arange(128, dtype=torch.float32).view(1, 2, 8, 4, 1, 2)  # 8 blocks of 4 tokens
    config = TierConfig(host_blocks=host, disk_blocks=disk, disk_dir=str(tmp_path))
    return KVTiers(kv, config, block_size=4), kv


def where(events) -> list[tuple[str, str, int]]:
    return [("+" if isinstance(e, BlockStored) else "-", e.medium, h) for e in events for h in e.block_hashes]


def test_evicted_blocks_go_down_least_recently_used_first_and_only_reused_ones_reach_the_disk(tmp_path):
    tiers, _ = tiers_over(tmp_path, host=2, disk=2)
    H, D = TIER_HOST, TIER_DISK
    assert where(tiers.offload(1, 0, hit=True)) == [("+", H, 1)]
    assert where(tiers.offload(2, 1, hit=True)) == [("+", H, 2)]
    # the host tier is full: its least recently used block (1, reused while cached) goes down to disk
    assert where(tiers.offload(3, 2, hit=False)) == [("-", H, 1), ("+", D, 1), ("+", H, 3)]
    assert tiers.find(2) == H  # touched: 3 is now the least recently used
    # 3 was never reused: evicted from the host tier, it is only remembered, not written
    assert where(tiers.offload(4, 3, hit=True)) == [("-", H, 3), ("+", H, 4)]
    assert tiers.find(3) is None
    # computed again and evicted again, 3 has been seen twice: from the host tier it now goes to disk,
    # pushing out the disk's least recently used block
    assert where(tiers.offload(3, 2, hit=False)) == [("-", H, 2), ("+", D, 2), ("+", H, 3)]
    assert where(tiers.offload(5, 4, hit=False)) == [("-", H, 4), ("-", D, 1), ("+", D, 4), ("+", H, 5)]
    assert where(tiers.offload(6, 5, hit=False)) == [("-", H, 3), ("-", D, 2), ("+", D, 3), ("+", H, 6)]
    assert [tiers.find(h) for h in (1, 2, 3, 4, 5, 6)] == [None, None, D, D, H, H]
    # inclusive: offloading a block a tier already holds copies nothing and emits nothing
    assert tiers.offload(5, 4, hit=True) == []
    tiers.close()


def test_without_a_host_tier_the_pool_evicts_straight_to_disk_and_blocks_come_back_byte_for_byte(tmp_path):
    tiers, kv = tiers_over(tmp_path, host=0, disk=4)
    original = kv[:, :, 3].clone()
    assert where(tiers.offload(7, 3, hit=True)) == [("+", TIER_DISK, 7)]
    assert tiers.flush(30.0)
    kv[:, :, 3] = -1  # the pool reuses the block
    done, events = tiers.onboard([(7, 5)])
    assert (done, events) == (1, [])
    assert torch.equal(kv[:, :, 5], original)
    assert {u.tier: u.hits for u in tiers.usage()} == {TIER_DISK: 1}
    assert [(run.tier, run.blocks) for run in tiers.take_onboarded()] == [(TIER_DISK, 1)]
    assert tiers.take_onboarded() == []
    tiers.close()


# ---- through the engine core: onboarding before the prefill, the disk's files, corruption


def core(tmp_path, **config) -> MockerCore:
    config = dict(num_kv_blocks=12, block_size=BS, max_num_batched_tokens=4096,
                  kv_disk_dir=str(tmp_path)) | config
    return MockerCore(EngineConfig(**config), PROFILE, 1.0)


def disk_gb(blocks: int) -> float:
    return (blocks + 0.5) * (PROFILED_BLOCK + _HEADER.size) / 2**30


def host_gb(blocks: int) -> float:
    return (blocks + 0.5) * PROFILED_BLOCK / 2**30


def prompt(seed: int, blocks: int = 4) -> list[int]:
    return [1000 + seed * 100 + i for i in range(blocks * BS + 1)]  # full blocks and one token more


def serve(c: MockerCore, rid: str, ids: list[int]) -> tuple[int, float]:
    """Run one request alone to its end: (prompt tokens served from cache, seconds of its first step)."""
    c.add_request(EngineRequest(request_id=rid, prompt_token_ids=ids, sampling=SamplingParams(temperature=0),
                                stop=StopConditions(max_tokens=2, ignore_eos=True)))
    first_step_s, usage = None, None
    while c.has_work:
        for out in c.step():
            usage = out.usage or usage
        first_step_s = c.step_s if first_step_s is None else first_step_s
    return usage.cached_tokens, first_step_s


def kv_tokens(c: MockerCore, ids: list[int]) -> list[int]:
    """The token ids the stand-in KV holds in the pool blocks cached for `ids`'s full blocks."""
    bm = c.block_manager
    blocks = [bm.cached[h] for h in block_hashes(ids, BS)]
    return c.kv_cache[0, 0, blocks, :, 0, 0].flatten().long().tolist()


def evict_all(c: MockerCore, rounds: int = 3) -> None:
    """Prompts used once each, enough to push every earlier block out of the pool."""
    for i in range(rounds):
        serve(c, f"filler-{i}", prompt(50 + i, blocks=10))


def test_a_prefix_evicted_to_the_host_and_then_the_disk_is_copied_back_before_its_prefill(tmp_path):
    c = core(tmp_path, kv_host_gb=host_gb(4), kv_disk_gb=disk_gb(16))
    a = prompt(1)
    assert serve(c, "a0", a)[0] == 0
    cached, _ = serve(c, "a1", a)
    assert cached == 4 * BS  # a prefix hit: its blocks were used twice
    evict_all(c)  # pool -> host (4 blocks) -> disk
    tiers = c.block_manager.tiers
    assert [tiers.find(h) for h in block_hashes(a, BS)] == [TIER_DISK] * 4
    c.block_manager.drain_events()
    cached, first_step_s = serve(c, "a2", a)
    assert cached == 4 * BS, "served from the disk tier, not recomputed"
    assert kv_tokens(c, a) == a[:4 * BS], "the blocks copied back hold the prefix's KV"
    # its first step: the profile's disk read of 4 blocks, then 1 token computed over 64 cached ones
    onboard_s = PROFILE.onboard_s(TIER_DISK, 4 * BS)
    assert first_step_s == pytest.approx(onboard_s + PROFILE.prefill_time_ms(1, 64) / 1e3)
    stored = [e for e in c.block_manager.drain_events() if isinstance(e, BlockStored) and e.medium is None]
    assert stored and stored[0].block_hashes == block_hashes(a, BS), "the device tier's event for them"
    use = {u.tier: u for u in c.stats().tiers}
    assert use[TIER_DISK].hits == 4 and use[TIER_DISK].onboarded_bytes == 4 * PROFILED_BLOCK
    assert use[TIER_DISK].onboarded_seconds == pytest.approx(PROFILE.onboard_s(TIER_DISK, 4 * BS))
    assert c.stats().fetch.disk_bytes_per_s == pytest.approx(PROFILE.disk_gb_per_s * 1e9)
    # a worker's /metrics: each tier's blocks, hits and what they onboarded
    endpoint = WorkerEndpoint()
    endpoint.add(SimpleNamespace(worker_id="w", ready=True, engine_stats=c.stats,
                                 transfer_counters=lambda: None))
    samples = {(sample.name, sample.labels.get("tier")): sample.value
               for family in text_string_to_metric_families(generate_latest(endpoint.registry).decode())
               for sample in family.samples}
    prefix = "dynamo_pd_worker_kv_"
    assert samples[prefix + "blocks_total", "host"] == 4 and samples[prefix + "blocks_total", "disk"] == 16
    assert samples[prefix + "tier_hits_total", "disk"] == 4
    assert samples[prefix + "tier_hits_total", "host"] == 0
    assert samples[prefix + "onboarded_bytes_total", "disk"] == 4 * PROFILED_BLOCK
    assert samples[prefix + "tier_corrupt_total", "disk"] == 0
    c.close()


def test_disk_files_stay_within_their_bound_and_go_when_the_engine_stops(tmp_path):
    c = core(tmp_path, kv_disk_gb=disk_gb(6))
    tiers = c.block_manager.tiers
    for i in range(6):
        ids = prompt(i)
        serve(c, f"p{i}-0", ids)
        serve(c, f"p{i}-1", ids)  # reused: it may go to disk
        assert tiers.flush(30.0)
        files = list(tiers.disk_path.glob("*.kv"))
        assert len(files) <= 6 and len(files) == c.stats().tiers[0].blocks
    assert len(list(tiers.disk_path.glob("*.kv"))) == 6, "the bound is reached: older files were deleted"
    path = tiers.disk_path
    assert path.parent == tmp_path
    c.close()
    assert not path.exists()


def test_one_off_prompts_never_reach_the_disk(tmp_path):
    c = core(tmp_path, kv_disk_gb=disk_gb(32))
    for i in range(8):
        serve(c, f"once-{i}", prompt(i))
    assert c.block_manager.tiers.flush(30.0)
    assert list(c.block_manager.tiers.disk_path.glob("*.kv")) == []
    c.close()


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "emptied header"])
def test_a_damaged_disk_block_is_detected_dropped_and_recomputed_never_served(tmp_path, damage):
    c = core(tmp_path, kv_disk_gb=disk_gb(16))
    a = prompt(1)
    serve(c, "a0", a)
    serve(c, "a1", a)
    evict_all(c)
    tiers = c.block_manager.tiers
    assert tiers.flush(30.0)
    hashes = block_hashes(a, BS)
    assert [tiers.find(h) for h in hashes] == [TIER_DISK] * 4
    victim = tiers.disk_path / f"{hashes[2]:016x}.kv"
    raw = bytearray(victim.read_bytes())
    if damage == "flipped byte":
        raw[-5] ^= 0x40
    elif damage == "truncated":
        raw = raw[:-100]
    else:
        raw[:_HEADER.size] = bytes(_HEADER.size)
    victim.write_bytes(bytes(raw))
    c.block_manager.drain_events()
    cached, _ = serve(c, "a2", a)
    assert cached == 2 * BS, "the two blocks before the damaged one came back; from it on, recomputed"
    assert kv_tokens(c, a) == a[:4 * BS], "the damaged block's bytes were never served"
    removed = [e for e in c.block_manager.drain_events()
               if isinstance(e, BlockRemoved) and e.medium == TIER_DISK]
    assert [h for e in removed for h in e.block_hashes] == [hashes[2]]
    assert not victim.exists() and tiers.find(hashes[2]) is None
    assert c.stats().tiers[0].corrupt == 1
    c.close()


def test_a_fresh_mocker_reports_its_profiled_links_until_moves_measure_them(tmp_path):
    # FETCH_PRIOR (the router's guess for a worker that never fetched) prices a pull 40x slower than the
    # profiled NIC: a mocker reporting nothing would never be planned its first pull
    c = MockerCore(EngineConfig(num_kv_blocks=8, block_size=BS, extra={}), PROFILE, speedup=0.5)
    fetch = c.stats().fetch
    assert fetch.pull_bytes_per_s == pytest.approx(PROFILE.transfer_gb_per_s * 1e9 * 0.5)
    assert fetch.host_bytes_per_s == pytest.approx(PROFILE.host_gb_per_s * 1e9 * 0.5)
    assert fetch.disk_bytes_per_s == pytest.approx(PROFILE.disk_gb_per_s * 1e9 * 0.5)
    assert fetch.pull_fixed_s == fetch.host_fixed_s == 0.0
    c.close()
