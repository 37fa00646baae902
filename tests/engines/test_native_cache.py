"""Prefix cache, KV events, preemption and abort on the native engine core."""

from __future__ import annotations

import pytest

from dynamo_pd.engines.base import EngineConfig
from dynamo_pd.engines.native.core import EngineCore
from dynamo_pd.protocol import EngineRequest, SamplingParams, StopConditions
from router.events import AllBlocksCleared, BlockRemoved, BlockStored
from router.hashing import block_hashes, local_block_hashes, salt_root, sequence_hashes

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0)


def request(rid: str, ids: list[int], max_tokens: int = 16, **kw) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=ids, sampling=GREEDY,
                         stop=StopConditions(max_tokens=max_tokens, ignore_eos=True), **kw)


def run(core: EngineCore, requests: list[EngineRequest]) -> dict:
    for r in requests:
        core.add_request(r)
    outs: dict = {r.request_id: [] for r in requests}
    while core.has_work:
        for out in core.step():
            outs[out.request_id].append(out)
    return outs


def tokens(outs: list) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def assert_no_block_in_use(core: EngineCore) -> None:
    bm = core.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not any(bm.ref_counts)


def replay(events, state: set[int], block_size: int) -> None:
    """Apply events as an indexer would, checking each one is exact."""
    for e in events:
        if isinstance(e, BlockStored):
            parent = salt_root(e.lora_name) if e.parent_block_hash is None else e.parent_block_hash
            assert e.parent_block_hash is None or parent in state, "stored under a parent that is not cached"
            assert e.block_size == block_size and len(e.token_ids) == block_size * len(e.block_hashes)
            assert e.block_hashes == sequence_hashes(local_block_hashes(e.token_ids, block_size), parent)
            assert state.isdisjoint(e.block_hashes), "stored twice without a removal"
            state.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            assert set(e.block_hashes) <= state, "removed a block that was never stored"
            state.difference_update(e.block_hashes)
        else:
            assert isinstance(e, AllBlocksCleared)
            state.clear()


@pytest.fixture(scope="module")
def small_core():
    return EngineCore(EngineConfig(num_kv_blocks=20))


def test_kv_events_track_stored_and_evicted_blocks(small_core, prompt_ids):
    core, bm = small_core, small_core.block_manager
    core.reset_prefix_cache()
    state: set[int] = set()
    replay(bm.drain_events(), state, bm.block_size)
    run(core, [request(f"a{i}", ids) for i, ids in enumerate(prompt_ids)])
    replay(bm.drain_events(), state, bm.block_size)
    assert state == set(bm.cached) and state
    for ids in prompt_ids:  # every full prompt block is in the cache under the router's hash
        assert set(block_hashes(ids, bm.block_size)) <= state

    # Different prompts that need more blocks than are free and uncached: old blocks get evicted.
    shifted = [[t + 7 for t in ids] for ids in prompt_ids]
    run(core, [request(f"b{i}", ids, max_tokens=24) for i, ids in enumerate(shifted)])
    events = bm.drain_events()
    assert any(isinstance(e, BlockRemoved) for e in events)
    replay(events, state, bm.block_size)
    assert state == set(bm.cached)
    assert_no_block_in_use(core)

    core.reset_prefix_cache()
    events = bm.drain_events()
    assert events == [AllBlocksCleared()]
    replay(events, state, bm.block_size)
    assert state == set(bm.cached) == set()


def test_repeated_prompt_reuses_blocks_and_salt_isolates(small_core, prompt_ids):
    core, bm = small_core, small_core.block_manager
    core.reset_prefix_cache()
    ids = prompt_ids[3]
    first = run(core, [request("r1", ids)])["r1"]
    again = run(core, [request("r2", ids)])["r2"]
    assert tokens(again) == tokens(first)
    assert first[-1].usage.cached_tokens == 0
    assert again[-1].usage.cached_tokens == (len(ids) - 1) // bm.block_size * bm.block_size

    bm.drain_events()
    salted = run(core, [request("r3", ids, cache_salt="tenant-a")])["r3"]
    assert salted[-1].usage.cached_tokens == 0, "a salted request must not hit unsalted blocks"
    assert tokens(salted) == tokens(first)
    stored = [e for e in bm.drain_events() if isinstance(e, BlockStored)]
    assert stored[0].parent_block_hash is None and stored[0].lora_name == "tenant-a"
    salted_hashes = [h for e in stored for h in e.block_hashes]
    assert salted_hashes[: len(ids) // bm.block_size] == block_hashes(ids, bm.block_size, salt="tenant-a")
    assert_no_block_in_use(core)


def test_preemption_recomputes_and_leaks_nothing(prompt_ids):
    roomy = EngineCore(EngineConfig(num_kv_blocks=64))
    expected = run(roomy, [request(f"p{i}", ids, max_tokens=24) for i, ids in enumerate(prompt_ids)])
    del roomy
    # 8 blocks of 16 tokens: each request fits alone, all four together do not.
    tiny = EngineCore(EngineConfig(num_kv_blocks=8))
    got = run(tiny, [request(f"p{i}", ids, max_tokens=24) for i, ids in enumerate(prompt_ids)])
    assert tiny.scheduler.num_preemptions > 0
    assert {rid: tokens(o) for rid, o in got.items()} == {rid: tokens(o) for rid, o in expected.items()}
    assert all(o[-1].usage.completion_tokens == 24 for o in got.values())
    assert_no_block_in_use(tiny)


def test_abort_mid_prefill_and_mid_decode_frees_blocks(small_core, prompt_ids):
    core = small_core
    core.scheduler.max_num_batched_tokens = 16  # the long prompt needs several chunks
    try:
        fresh = [t + 3 for t in prompt_ids[3]]  # not in the prefix cache
        core.add_request(request("decoding", prompt_ids[0], max_tokens=100))
        core.add_request(request("prefilling", fresh, max_tokens=100))
        core.step()
        core.step()
        assert core.seqs["prefilling"].num_computed_tokens < len(fresh)
        assert len(core.seqs["decoding"].output_token_ids) >= 1
        for rid in ("prefilling", "decoding"):
            out = core.end_request(rid, "abort")
            assert out.finish_reason == "abort" and out.usage.prompt_tokens > 0
        assert core.end_request("decoding", "abort") is None  # already gone
        assert not core.has_work
        assert_no_block_in_use(core)
    finally:
        core.scheduler.max_num_batched_tokens = core.config.max_num_batched_tokens
