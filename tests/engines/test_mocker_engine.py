"""MockerEngine behind the async contract: the native engine's streaming, cancellation, hand-off,
lease and load-failure tests run against mockers, and its step and transfer times on a fake clock."""

from __future__ import annotations

import asyncio
import time

import pytest

# The native engine's tests, run here on mockers (their `engines` fixture is this module's).
from test_native_engine import (  # noqa: F401 - collected here
    CopyLoader,
    collect,
    request,
    test_cancel_and_closing_the_stream_abort_and_free_blocks,
    test_decode_rejects_inconsistent_handoff,
    test_decode_without_handoff_prefills_locally,
    test_failed_kv_load_ends_with_error_and_frees_blocks,
    test_handoff_lease_expires,
    test_prefill_to_decode_handoff_matches_aggregated,
    test_streams_deltas_concurrently,
    tokens_of,
    wait_idle,
)

from dynamo_pd.engines.base import EngineConfig, EngineRole, create_engine
from dynamo_pd.engines.mocker.engine import FakeClock, MockerEngine
from dynamo_pd.engines.native.grammar import huggingface_grammars
from dynamo_pd.runtime import RequestContext

pytestmark = pytest.mark.slow  # the served model's tokenizer and config
SPEEDUP = 20.0


async def start_engines(clock=None, speedup: float = SPEEDUP, **config):
    def make(role, **kw):
        return MockerEngine(EngineConfig(role=role, num_kv_blocks=48, extra={"speedup": speedup}, **config),
                            clock=clock, **kw)

    aggregated, prefill = make(EngineRole.AGGREGATED), make(EngineRole.PREFILL)
    loader = CopyLoader(prefill)
    decode = loader.target = make(EngineRole.DECODE, kv_loader=loader)
    for engine in (aggregated, prefill, decode):
        await engine.start()
    return aggregated, prefill, decode, loader


@pytest.fixture
async def engines():
    """Real time, sped up: the clock a deployment uses."""
    engines = await start_engines()
    yield engines
    for engine in engines[:3]:
        await engine.stop()


async def decode_costs(own_work_s: float):
    """A mocker on a fake clock, each step's delivery taking own_work_s of it: the step costs it measures
    decoding 4 requests."""
    clock = FakeClock()
    engine = MockerEngine(EngineConfig(num_kv_blocks=48, extra={"speedup": 1.0}), clock=clock)
    deliver = engine._deliver

    def slow_deliver(outputs, counted_at):
        clock.t += own_work_s
        deliver(outputs, counted_at)

    engine._deliver = slow_deliver
    await engine.start()
    try:
        await asyncio.gather(*[collect(engine, request(f"r{i}", [300 + i] * 64, max_tokens=40))
                               for i in range(4)])
        return engine._core.step_costs.costs()
    finally:
        await engine.stop()


async def test_a_started_engine_has_its_grammar_tables():
    """start() returns once the vocabulary's grammar tables are built (their build holds the GIL for
    seconds: a worker registered before it served its first requests that much later)."""
    huggingface_grammars.cache_clear()  # the tables of this process's earlier engines are not this one's
    engine = MockerEngine(EngineConfig(num_kv_blocks=48, extra={"speedup": SPEEDUP}))
    await engine.start()
    try:
        assert engine._core.grammars._compiler is not None
    finally:
        await engine.stop()


async def test_the_stats_say_when_their_requests_were_counted(engines):
    """EngineStats.counted_at: the start of the step the stats come from, in real time (a router takes a
    request placed after it as not yet in them, router/load.py)."""
    aggregated = engines[0]
    before = time.monotonic()
    await collect(aggregated, request("r", [300] * 64, max_tokens=4))
    assert before <= aggregated.stats.counted_at <= time.monotonic()


async def test_measured_step_costs_are_what_steps_take_with_the_engines_own_work():
    """The step costs a mocker reports (the router and the planner predict with them) are what its steps
    take as its requests see them. Back to back, the process's own work on a step within the catch-up window
    is made up by the next step's shorter sleep (steps keep the profile's time); beyond it, a step takes the
    profile's time plus that work, and so do the costs."""
    profiled, made_up, stalled = await decode_costs(0.0), await decode_costs(1e-3), await decode_costs(20e-3)
    assert made_up.decode_s == pytest.approx(profiled.decode_s, rel=1e-6)
    assert stalled.decode_s - profiled.decode_s == pytest.approx(20e-3, rel=1e-3)
    for costs in (made_up, stalled):
        assert costs.decode_s_per_block == pytest.approx(profiled.decode_s_per_block)


async def test_a_sped_up_mocker_runs_the_steps_it_is_behind_on_without_a_turn_of_the_loop_each():
    """At --speedup 1000 a decode step is a few microseconds, far shorter than a turn of a busy process's loop
    (here a neighbour that works 1 ms each turn): steps run back to back for up to a millisecond, so 128
    tokens take far fewer turns than tokens. One step a turn took 128 or more."""
    engine = MockerEngine(EngineConfig(num_kv_blocks=48, extra={"speedup": 1000.0}))
    await engine.start()
    turns = 0

    async def neighbour():
        nonlocal turns
        while True:
            time.sleep(1e-3)
            turns += 1
            await asyncio.sleep(0)

    busy = asyncio.create_task(neighbour())
    try:
        outs = await collect(engine, request("r", [1, 2, 3], max_tokens=128))
    finally:
        busy.cancel()
        await engine.stop()
    assert len(tokens_of(outs)) == 128
    assert turns < 0.75 * 128, f"{turns} turns of the loop for 128 tokens"


async def test_the_registry_builds_a_mocker_that_serves_plain_text():
    engine = create_engine("mocker", EngineConfig(num_kv_blocks=8, extra={"speedup": SPEEDUP}))
    await engine.start()
    try:
        outs = await collect(engine, request("r", [1, 2, 3], max_tokens=4))
        assert "".join(o.text for o in outs).isprintable() and len(tokens_of(outs)) == 4
    finally:
        await engine.stop()


async def test_requests_take_the_profiled_time_on_a_fake_clock():
    clock = FakeClock()
    aggregated, prefill, decode, _ = engines = await start_engines(clock, speedup=2.0)
    profile = aggregated.profile
    try:
        prompts = [[300 + i] * 64 for i in range(4)]  # 4 x 64 tokens: one 256-token prefill step
        await asyncio.gather(*[collect(aggregated, request(f"a{i}", ids, max_tokens=6))
                               for i, ids in enumerate(prompts)])
        expected = profile.prefill_time_ms(256, 0) + sum(profile.decode_time_ms(4, 64 + k) for k in range(5))
        assert clock.now() == pytest.approx(expected / 1e3 / 2)

        # Disaggregated: the decode side waits the profiled model's KV transfer, then decodes.
        (done,) = await collect(prefill, request("p", prompts[0], max_tokens=6))
        start = clock.now()
        outs = await collect(decode, request("d", prompts[0], max_tokens=6, handoff=done.handoff,
                                             first_token_id=done.token_ids[0]))
        assert len(tokens_of(outs)) == 6
        transfer_s = 64 * profile.kv_bytes_per_token / (profile.transfer_gb_per_s * 1e9)
        decode_ms = sum(profile.decode_time_ms(1, 64 + k) for k in range(5))
        assert clock.now() - start == pytest.approx((transfer_s + decode_ms / 1e3) / 2)
        await prefill.release_handoff("p")
        for engine in engines[:3]:
            await wait_idle(engine)
    finally:
        for engine in engines[:3]:
            await engine.stop()


async def test_the_handoff_moves_the_stand_in_kv_of_the_prompt(engines):
    _, prefill, decode, loader = engines
    ids = list(range(500, 540))
    (done,) = await collect(prefill, request("p", ids))
    await collect(decode, request("d", ids, handoff=done.handoff, first_token_id=done.token_ids[0]))
    local_blocks = loader.calls[-1][0]
    got = decode.kv_cache[0, 0, local_blocks, :, 0, 0].flatten()[:len(ids)]
    assert got.tolist() == [float(t) for t in ids]
    await prefill.release_handoff("p")
    await wait_idle(prefill)


async def test_stop_ends_running_requests_and_frees_every_block():
    engine = MockerEngine(EngineConfig(num_kv_blocks=16, extra={"speedup": 1.0}))
    await engine.start()
    first = asyncio.Event()
    outputs = []

    async def consume() -> None:  # waiting for its next token when the engine stops
        async for out in engine.generate(request("long", [7] * 40, max_tokens=100), RequestContext("long")):
            outputs.append(out)
            first.set()

    consumer = asyncio.create_task(consume())
    await asyncio.wait_for(first.wait(), 10)
    await engine.stop()
    await asyncio.wait_for(consumer, 10)
    assert outputs[-1].finish_reason == "abort" and len(outputs) < 100
    assert engine.stats.num_free_blocks == engine.stats.num_total_blocks


@pytest.mark.parametrize("extra, message", [
    ({"speedup": 0}, "speedup must be positive"),
    ({"speeedup": 2}, "unknown mocker option"),
    ({"profile": "/nonexistent.json"}, "nonexistent"),
])
def test_bad_mocker_options_are_refused(extra, message):
    with pytest.raises((ValueError, OSError), match=message):
        MockerEngine(EngineConfig(extra=extra))
