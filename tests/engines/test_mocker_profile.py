"""The mocker's default profile against facts it was not built from: Llama-3.1-8B's published size and
config, the H100 SXM's datasheet peaks, what they imply (every step at least as slow as the peak allows,
no slower than a plausible serving engine, in the shape of a roofline), and the mocker engine's own
times on its fake clock. Nothing here calls the module's roofline: a wrong constant or FLOP count
there shows up as a step time outside these bounds."""

from __future__ import annotations

import asyncio
import itertools

import msgspec
import pytest
from test_native_engine import collect, request, tokens_of

from dynamo_pd.engines.base import EngineConfig
from dynamo_pd.engines.mocker.engine import FakeClock, MockerEngine
from dynamo_pd.engines.mocker.profile import ModelShape, Profile, h100_llama8b

PROFILE = h100_llama8b()

# meta-llama/Llama-3.1-8B: config.json, and the model card's 8.03 B parameters (bf16 weights)
LAYERS, HIDDEN, HEADS, KV_HEADS, VOCAB = 32, 4096, 32, 8, 128256
HEAD_DIM = HIDDEN // HEADS
PARAMS = 8.03e9
EMBEDDING = LM_HEAD = VOCAB * HIDDEN  # untied (tie_word_embeddings: false); the embedding is a row lookup
BF16 = 2
KV_BYTES_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * BF16  # K and V of every layer's 8 KV heads
ATTENTION_FLOPS_PER_PAIR = 2 * 2 * HEAD_DIM * HEADS * LAYERS  # q.k and p.v, per (query, key) pair

# H100 SXM, NVIDIA's datasheet: 989 TFLOPS dense BF16 (1979 is with sparsity), 3.35 TB/s HBM3; one
# 400 Gb/s ConnectX-7 NIC per GPU in a DGX H100
PEAK_FLOPS, PEAK_BYTES_S, NIC_BYTES_S = 989e12, 3.35e12, 400e9 / 8
RIDGE = PEAK_FLOPS / PEAK_BYTES_S  # ~295 FLOPs per byte: below it a step waits on memory, above on compute

# Ceilings (assumptions, looser than any tuned H100 engine): at least 40% of peak compute, 50% of peak
# bandwidth, at most 2 ms a step outside the model
MIN_COMPUTE, MIN_BANDWIDTH, MAX_OVERHEAD_MS = 0.4, 0.5, 2.0


def fastest_ms(flops: float, nbytes: float) -> float:
    """No step beats the hardware's peaks."""
    return max(flops / PEAK_FLOPS, nbytes / PEAK_BYTES_S) * 1e3


def slowest_ms(flops: float, nbytes: float) -> float:
    compute_s, memory_s = flops / (PEAK_FLOPS * MIN_COMPUTE), nbytes / (PEAK_BYTES_S * MIN_BANDWIDTH)
    return max(compute_s, memory_s) * 1e3 + MAX_OVERHEAD_MS


def prefill_bounds(new: int, cached: int) -> tuple[float, float]:
    """A forward pass over `new` prompt tokens after `cached` ones: at least every layer's weights
    multiplied by each new token, causal attention to the cache and to the earlier new tokens, and
    every weight but the embedding read once with the cache's KV; at most the LM head on every row
    too, attention to all new tokens, every weight and the new tokens' KV written."""
    layer_params = PARAMS - EMBEDDING - LM_HEAD
    pairs = new * cached + new * (new + 1) / 2
    low = fastest_ms(2 * layer_params * new + ATTENTION_FLOPS_PER_PAIR * pairs,
                     (PARAMS - EMBEDDING) * BF16 + cached * KV_BYTES_PER_TOKEN)
    high = slowest_ms(2 * (PARAMS - EMBEDDING) * new + ATTENTION_FLOPS_PER_PAIR * new * (cached + new),
                      PARAMS * BF16 + (cached + new) * KV_BYTES_PER_TOKEN)
    return low, high


def decode_bounds(batch: int, context: int) -> tuple[float, float]:
    """One token for each of `batch` sequences with `context` tokens of KV: every weight but the
    embedding multiplied per token and read once, each sequence's KV read."""
    low = fastest_ms(2 * (PARAMS - EMBEDDING) * batch,
                     (PARAMS - EMBEDDING) * BF16 + batch * context * KV_BYTES_PER_TOKEN)
    high = slowest_ms(2 * PARAMS * batch + ATTENTION_FLOPS_PER_PAIR * batch * (context + 1),
                      PARAMS * BF16 + batch * (context + 1) * KV_BYTES_PER_TOKEN)
    return low, high


NEW = [1, 7, 64, 300, 1024, 2048, 5000, 16384, 32768]
CACHED = [0, 100, 1000, 8192, 30000, 120000]
BATCH = [1, 3, 8, 32, 100, 256, 1024]
CONTEXT = [0, 50, 700, 4096, 20000, 120000]


def test_the_profiled_shape_has_the_published_parameter_count():
    m = ModelShape()  # every layer's projections and MLP, the embedding and the LM head (norms: 0.27 M)
    assert m.num_layers * m.layer_weights + EMBEDDING + LM_HEAD == pytest.approx(PARAMS, rel=1e-3)


def test_kv_bytes_and_the_hand_off_link_match_the_model_and_the_nic():
    assert PROFILE.kv_bytes_per_token == KV_BYTES_PER_TOKEN == 131072
    one_k = 1024 * KV_BYTES_PER_TOKEN  # 134 MB
    assert one_k / NIC_BYTES_S <= PROFILE.transfer_s(1024) <= 2 * one_k / NIC_BYTES_S  # line rate .. half it


@pytest.mark.parametrize("new,cached", list(itertools.product(NEW, CACHED)))
def test_a_prefill_step_takes_between_the_h100_peak_and_a_slow_engine(new, cached):
    low, high = prefill_bounds(new, cached)
    assert low <= PROFILE.prefill_time_ms(new, cached) <= high, (low, high)


@pytest.mark.parametrize("batch,context", list(itertools.product(BATCH, CONTEXT)))
def test_a_decode_step_takes_between_the_h100_peak_and_a_slow_engine(batch, context):
    low, high = decode_bounds(batch, context)
    assert low <= PROFILE.decode_time_ms(batch, context) <= high, (low, high)


def test_more_work_never_takes_less_time():
    for cached in CACHED:
        times = [PROFILE.prefill_time_ms(n, cached) for n in range(1, 32769, 97)]
        assert times == sorted(times), cached
    for new in NEW:
        times = [PROFILE.prefill_time_ms(new, c) for c in range(0, 131073, 1009)]
        assert times == sorted(times), new
    for context in CONTEXT:
        times = [PROFILE.decode_time_ms(b, context) for b in range(1, 1025, 7)]
        assert times == sorted(times), context
    for batch in BATCH:
        times = [PROFILE.decode_time_ms(batch, k) for k in range(0, 131073, 1009)]
        assert times == sorted(times), batch


def test_decode_is_memory_bound_and_prefill_compute_bound_on_either_side_of_the_ridge():
    # A decode batch does ~1 FLOP per weight byte it streams per sequence, far below the ridge: 32
    # sequences cost little more than one (their KV and FLOPs are small beside 15 GB of weights).
    assert 32 < RIDGE / 8
    assert PROFILE.decode_time_ms(32, 128) < 1.25 * PROFILE.decode_time_ms(1, 128)
    # A prefill of n tokens does ~n FLOPs per weight byte: from 4 x the ridge on, twice the tokens
    # take about twice the time (attention makes it a little more).
    for n in (1024, 2048, 4096):
        assert n >= 3 * RIDGE
        assert 1.8 <= PROFILE.prefill_time_ms(2 * n, 0) / PROFILE.prefill_time_ms(n, 0) <= 2.3, n
    # Attention to a long cache: 1k tokens after 120k cached do 4.5x the FLOPs of 1k after none.
    assert PROFILE.prefill_time_ms(1024, 120000) >= 3 * PROFILE.prefill_time_ms(1024, 0)


def test_a_profile_round_trips_as_json_and_a_malformed_one_is_refused(tmp_path):
    path = tmp_path / "profile.json"
    path.write_bytes(msgspec.json.encode(PROFILE))
    assert Profile.load(path) == PROFILE
    with pytest.raises(ValueError, match="shape"):
        msgspec.structs.replace(PROFILE, decode_ms=PROFILE.decode_ms[1:])
    with pytest.raises(ValueError, match="increasing"):
        msgspec.structs.replace(PROFILE, decode_batch=[1, 1] + PROFILE.decode_batch[2:])


# ---- the mocker engine on its fake clock: what a client of a simulated H100 measures

SPEEDUP = 4.0
_prompt_ids = itertools.count(1000)


def prompts(count: int, length: int) -> list[list[int]]:
    """Distinct prompts (the prefix cache serves none of them from an earlier one)."""
    return [[next(_prompt_ids) % 40000 + 100] * length for _ in range(count)]


async def elapsed_s(engine: MockerEngine, batch: list[list[int]], max_tokens: int) -> float:
    """Seconds on the engine's clock for `batch`, sent at once, to finish; checks each got its tokens."""
    start = engine.clock.now()
    outs = await asyncio.gather(*[collect(engine, request(f"r{ids[0]}", ids, max_tokens=max_tokens))
                                  for ids in batch])
    assert [len(tokens_of(o)) for o in outs] == [max_tokens] * len(batch)
    return engine.clock.now() - start


async def started(speedup: float) -> MockerEngine:
    engine = MockerEngine(EngineConfig(num_kv_blocks=1024, max_num_batched_tokens=8192,
                                       extra={"speedup": speedup}), clock=FakeClock())
    await engine.start()
    return engine


@pytest.mark.slow  # the served model's tokenizer and config
async def test_the_mocker_engine_prefills_and_decodes_at_h100_speed_on_its_fake_clock():
    engine = await started(SPEEDUP)
    try:
        async def ms(batch: list[list[int]], max_tokens: int) -> float:  # in the profiled model's time
            return await elapsed_s(engine, batch, max_tokens) * SPEEDUP * 1e3

        low, high = prefill_bounds(4096, 0)
        assert low <= await ms(prompts(1, 4096), 1) <= high, (low, high)
        # one request: its prefill, then 32 decode steps at 128..159 tokens of context
        itl_ms = (await ms(prompts(1, 128), 33) - await ms(prompts(1, 128), 1)) / 32
        assert decode_bounds(1, 128)[0] <= itl_ms <= decode_bounds(1, 160)[1], itl_ms
        # 32 requests at once: one prefill step of 4096 tokens, then 32 decode steps of the whole batch
        batch_itl_ms = (await ms(prompts(32, 128), 33) - await ms(prompts(32, 128), 1)) / 32
        assert decode_bounds(32, 128)[0] <= batch_itl_ms <= decode_bounds(32, 160)[1], batch_itl_ms
        assert batch_itl_ms < 1.25 * itl_ms, "memory-bound: 32 tokens a step for about the price of one"
    finally:
        await engine.stop()


@pytest.mark.slow
async def test_the_speedup_divides_the_simulated_time():
    fast, slow = await started(SPEEDUP), await started(1.0)
    try:
        batch = prompts(3, 300)  # the same prompts on both: each engine has its own prefix cache
        assert await elapsed_s(fast, batch, 5) == pytest.approx(await elapsed_s(slow, batch, 5) / SPEEDUP)
    finally:
        await fast.stop()
        await slow.stop()


class WholeMsClock(FakeClock):
    """A fake clock whose sleeps last whole milliseconds, as uvloop's timers do (it rounds each delay)."""

    async def sleep(self, seconds: float) -> None:
        await super().sleep(round(seconds * 1e3) / 1e3)


@pytest.mark.slow
async def test_steps_take_the_profiled_time_on_average_whatever_the_timer_rounds():
    """Back to back, each step is timed from when the one before was due to end: 64 decode steps of ~6.6 ms
    each rounded to 7 ms would come 25 ms late."""
    engines = [MockerEngine(EngineConfig(num_kv_blocks=1024), clock=clock) for clock in (FakeClock(), WholeMsClock())]
    for engine in engines:
        await engine.start()
    try:
        exact, rounded = [await elapsed_s(engine, prompts(1, 128), 65) for engine in engines]
        assert exact > 64 * 6e-3
        assert rounded == pytest.approx(exact, abs=1e-3)
    finally:
        for engine in engines:
            await engine.stop()
