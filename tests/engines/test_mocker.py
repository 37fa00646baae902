"""MockerCore: step times against the profile, scheduling limits, and the native engine core's
prefix-cache, KV-event and abort tests run against it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

# The native core's tests, run here on MockerCore (their `small_core` is this module's fixture).
from test_native_cache import (  # noqa: F401 - collected here
    assert_no_block_in_use,
    request,
    run,
    test_abort_mid_prefill_and_mid_decode_frees_blocks,
    test_kv_events_track_stored_and_evicted_blocks,
    test_repeated_prompt_reuses_blocks_and_salt_isolates,
    tokens,
)

from dynamo_pd.engines.base import EngineConfig
from dynamo_pd.engines.mocker.core import MockerCore
from dynamo_pd.engines.mocker.profile import Gpu, ModelShape, decode_ms, h100_llama8b, prefill_ms
from router.hashing import block_hashes

pytestmark = pytest.mark.slow  # the served model's tokenizer and config
PROFILE = h100_llama8b()
MODEL, GPU = ModelShape(), Gpu()


def mocker_core(speedup: float = 1.0, **config) -> MockerCore:
    return MockerCore(EngineConfig(**config), PROFILE, speedup)


@pytest.fixture(scope="module")
def small_core():
    return mocker_core(num_kv_blocks=20)


def test_a_batch_of_known_size_takes_the_profiled_time():
    core = mocker_core(speedup=4.0, num_kv_blocks=256)
    prompts = [[100 + i] * 100 for i in range(8)]  # 8 prompts of 100 tokens: one 800-token prefill step
    for i, ids in enumerate(prompts):
        core.add_request(request(f"r{i}", ids, max_tokens=5))
    outputs = core.step()
    assert len(outputs) == 8 and all(len(o.token_ids) == 1 for o in outputs)
    assert core.step_s == pytest.approx(PROFILE.prefill_time_ms(800, 0) / 1e3 / 4)
    assert core.step_s == pytest.approx(prefill_ms(MODEL, GPU, 800, 0) / 1e3 / 4, rel=0.06)
    for k in range(4):  # then 4 decode steps of the 8 sequences, each 101 + k tokens into its KV
        outputs = core.step()
        assert len(outputs) == 8
        assert core.step_s == pytest.approx(PROFILE.decode_time_ms(8, 100 + k) / 1e3 / 4)
        assert core.step_s == pytest.approx(decode_ms(MODEL, GPU, 8, 100 + k) / 1e3 / 4, rel=0.065)
    assert all(o.finish_reason == "length" for o in outputs) and not core.has_work
    assert_no_block_in_use(core)


def test_max_num_seqs_and_the_token_budget_chunk_prefills_and_time_each_chunk():
    core = mocker_core(num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(3):
        core.add_request(request(f"r{i}", [200 + i] * 100, max_tokens=3))
    assert core.step() == [] and core.step_s == pytest.approx(PROFILE.prefill_time_ms(64, 0) / 1e3)
    assert [s.request_id for s in core.scheduler.running] == ["r0"]  # the budget went to r0's first chunk
    outputs = core.step()  # r0's last 36 tokens after 64 cached, r1's first 28
    assert [o.request_id for o in outputs] == ["r0"]
    assert core.step_s == pytest.approx(PROFILE.prefill_time_ms(64, (36 * 64 + 28 * 0) / 64) / 1e3)
    assert core.seqs["r1"].num_computed_tokens == 28
    seen_running = []
    while core.has_work:
        core.step()
        seen_running.append(len(core.scheduler.running))
    assert max(seen_running) == 2, "max_num_seqs caps the running batch"
    assert_no_block_in_use(core)


def test_preemption_when_blocks_run_out_recomputes_the_same_tokens(prompt_ids):
    requests = [request(f"p{i}", ids, max_tokens=24) for i, ids in enumerate(prompt_ids)]
    expected = run(mocker_core(num_kv_blocks=64), requests)
    tiny = mocker_core(num_kv_blocks=8)  # each request fits alone, all four together do not
    got = run(tiny, requests)
    assert tiny.scheduler.num_preemptions > 0
    assert {rid: tokens(o) for rid, o in got.items()} == {rid: tokens(o) for rid, o in expected.items()}
    assert_no_block_in_use(tiny)


def test_tokens_are_deterministic_plain_text_and_the_stand_in_kv_holds_the_prompt(prompt_ids):
    core = mocker_core(num_kv_blocks=64)
    ids = prompt_ids[3]
    first = run(core, [request("a", ids)])["a"]
    again = run(core, [request("b", ids)])["b"]
    assert tokens(first) == tokens(again), "greedy: the prompt decides, not the request id"
    table, real = core.tokenizer, AutoTokenizer.from_pretrained(core.model_dir)
    assert set(tokens(first)) <= set(table.plain) and not set(table.plain) & set(real.added_tokens_decoder)
    text = "".join(o.text for o in first)
    assert text == table.decode(tokens(first)) == real.decode(tokens(first), skip_special_tokens=True)
    # the stand-in KV of the prompt's first block, which the prefix cache kept, holds its token ids
    block = core.block_manager.cached[block_hashes(ids, core.block_manager.block_size)[0]]
    assert core.kv_cache[0, :, block, :, 0, :].eq(torch.tensor(ids[:16], dtype=torch.float32)[:, None]).all()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="holds no"):
        mocker_core(kv_cache_memory_gb=0.0001)
    with pytest.raises(ValueError, match="max_model_len"):
        mocker_core(max_model_len=10**6)


def test_a_health_canary_is_served_but_not_counted_in_the_output_lengths_reported():
    core = mocker_core(num_kv_blocks=256)
    core.add_request(request("r0", [100] * 40, max_tokens=8))
    core.add_request(request("health-w0-1", [7], max_tokens=1, probe=True))
    finished = set()
    while core.has_work:
        finished |= {o.request_id for o in core.step() if o.finish_reason is not None}
    assert finished == {"r0", "health-w0-1"}
    assert core.stats().costs.output_tokens == 8  # the request's 8, not the mean with the canary's 1
