"""The native engine's KV tiers on a real model: a 2,000-token prefix evicted from the pool to the host tier
and from there to disk comes back before its prefill, sooner than recomputing it, and the text is the text
of the run that never evicted it."""

from __future__ import annotations

import time

import pytest

from dynamo_pd.engines.base import EngineConfig
from dynamo_pd.engines.native.core import EngineCore
from dynamo_pd.protocol import EngineRequest, SamplingParams, StopConditions
from router.events import TIER_DISK, TIER_HOST
from router.hashing import block_hashes

pytestmark = pytest.mark.slow

BS = 16
PREFIX = 2000


def first_token_s_and_tokens(core: EngineCore, rid: str, ids: list[int]) -> tuple[float, list[int], int]:
    """(seconds to the first token, every token, prompt tokens served from cache) of one request run alone."""
    core.add_request(EngineRequest(request_id=rid, prompt_token_ids=ids,
                                   sampling=SamplingParams(temperature=0),
                                   stop=StopConditions(max_tokens=8, ignore_eos=True)))
    started, ttft, tokens, cached = time.perf_counter(), None, [], 0
    while core.has_work:
        for out in core.step():
            ttft = ttft if ttft is not None else time.perf_counter() - started
            tokens += out.token_ids
            cached = out.usage.cached_tokens if out.usage else cached
    return ttft, tokens, cached


def test_a_2000_token_prefix_comes_back_from_disk_faster_than_recomputed_with_the_same_text(tmp_path):
    bytes_per_block = 30 * 2 * BS * 3 * 64 * 4  # SmolLM2-135M in float32: 30 layers, 3 KV heads of 64
    core = EngineCore(EngineConfig(num_kv_blocks=140, block_size=BS, max_num_batched_tokens=2048,
                                   kv_host_gb=8.5 * bytes_per_block / 2**30,
                                   kv_disk_gb=200.5 * (bytes_per_block + 28) / 2**30,
                                   kv_disk_dir=str(tmp_path)))
    tiers = core.block_manager.tiers
    prompt = [(7 * i) % 40000 + 100 for i in range(PREFIX)] + [11, 12, 13]
    cold_s, cold, cached = first_token_s_and_tokens(core, "cold", prompt)  # never evicted: computed
    assert cached == 0
    _, again, cached = first_token_s_and_tokens(core, "again", prompt)  # a hit: used twice, disk-worthy
    assert again == cold and cached == PREFIX // BS * BS
    for i in range(3):  # one-off prompts push every block of it out of the pool, through the host tier
        first_token_s_and_tokens(core, f"filler-{i}", [40000 + 1000 * i + j for j in range(800)])
    hashes = block_hashes(prompt, BS)
    assert not set(hashes) & set(core.block_manager.cached), "the prefix left the pool"
    assert {tiers.find(h) for h in hashes} == {TIER_DISK}, "and the host tier, for the disk"
    assert tiers.flush(60.0)
    assert len(list(tiers.disk_path.glob("*.kv"))) == len(hashes)

    warm_s, warm, cached = first_token_s_and_tokens(core, "warm", prompt)
    assert cached == PREFIX // BS * BS, "copied back from disk, not recomputed"
    assert warm == cold, "the text of the run that never evicted it"
    assert warm_s < cold_s, f"first token after {warm_s:.2f}s from disk, {cold_s:.2f}s recomputed"
    use = {u.tier: u for u in core.stats().tiers}
    assert use[TIER_DISK].hits == len(hashes) and use[TIER_HOST].hits == 0
    print(f"\nTTFT of a {PREFIX}-token prefix: recomputed {cold_s:.3f}s, from disk {warm_s:.3f}s "
          f"({use[TIER_DISK].onboarded_bytes / 2**20:.0f} MiB in {use[TIER_DISK].onboarded_seconds:.3f}s)")
    path = tiers.disk_path
    core.close()
    assert not path.exists()
