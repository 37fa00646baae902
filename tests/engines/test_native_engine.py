"""NativeEngine behind the async contract: streaming, cancellation, and prefill -> decode hand-off."""

from __future__ import annotations

import asyncio

import pytest
import torch

from dynamo_pd.engines.base import EngineConfig, EngineRole, create_engine
from dynamo_pd.engines.native.engine import NativeEngine
from dynamo_pd.handoff import HandoffTimes
from dynamo_pd.protocol import (
    EngineOutput,
    EngineRequest,
    InvalidRequestError,
    SamplingParams,
    StopConditions,
)
from dynamo_pd.runtime import RequestContext
from router.events import BlockStored
from router.hashing import block_hashes

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0)


def request(rid: str, ids: list[int], max_tokens: int = 12, **kw) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=ids, sampling=GREEDY,
                         stop=StopConditions(max_tokens=max_tokens, ignore_eos=True), **kw)


async def collect(engine, req: EngineRequest, context: RequestContext | None = None) -> list[EngineOutput]:
    return [out async for out in engine.generate(req, context or RequestContext(req.request_id))]


def tokens_of(outputs: list[EngineOutput]) -> list[int]:
    return [t for out in outputs for t in out.token_ids]


class CopyLoader:
    """Moves KV blocks tensor-to-tensor between two engines in one process; fails on demand."""

    def __init__(self, source: NativeEngine):
        self.source = source
        self.target: NativeEngine | None = None
        self.calls: list[tuple[list[int], int]] = []
        self.unreachable: set[str] = set()  # prefill request ids whose KV cannot be reached

    async def __call__(self, handoff, local_block_ids, cached_blocks):
        self.calls.append((list(local_block_ids), cached_blocks))
        if handoff.request_id in self.unreachable:
            raise ConnectionError("prefill worker unreachable")
        src = torch.tensor(handoff.block_ids[cached_blocks:])
        dst = torch.tensor(local_block_ids[cached_blocks:])
        self.target.kv_cache[:, :, dst] = self.source.kv_cache[:, :, src]


@pytest.fixture(scope="module")
def engines():
    aggregated = create_engine("native", EngineConfig(num_kv_blocks=48))
    prefill = NativeEngine(EngineConfig(role=EngineRole.PREFILL, num_kv_blocks=48))
    loader = CopyLoader(prefill)
    decode = NativeEngine(EngineConfig(role=EngineRole.DECODE, num_kv_blocks=48), kv_loader=loader)
    loader.target = decode
    for engine in (aggregated, prefill, decode):
        asyncio.run(engine.start())
    yield aggregated, prefill, decode, loader
    for engine in (aggregated, prefill, decode):
        asyncio.run(engine.stop())


async def wait_idle(engine: NativeEngine, timeout: float = 10.0) -> None:
    """Until nothing runs, waits or is held and every block is free again."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        s = engine.stats
        if s.num_running == s.num_waiting == s.num_loading == s.num_held == 0 and \
                s.num_free_blocks == s.num_total_blocks:
            return
        assert asyncio.get_running_loop().time() < deadline, f"engine not idle: {s}"
        await asyncio.sleep(0.02)


async def test_streams_deltas_concurrently(engines, prompt_ids):
    aggregated = engines[0]
    alone = [await collect(aggregated, request(f"solo{i}", ids)) for i, ids in enumerate(prompt_ids)]
    together = await asyncio.gather(*[collect(aggregated, request(f"par{i}", ids))
                                      for i, ids in enumerate(prompt_ids)])
    for outs, ref in zip(together, alone):
        assert tokens_of(outs) == tokens_of(ref)
        assert len(outs) == 12 and all(len(o.token_ids) == 1 for o in outs)
        assert "".join(o.text for o in outs) == aggregated.tokenizer.decode(tokens_of(outs), skip_special_tokens=True)
        assert outs[-1].finish_reason == "length" and outs[-1].usage.completion_tokens == 12
        assert all(o.finish_reason is None for o in outs[:-1])
    await wait_idle(aggregated)


async def test_cancel_and_closing_the_stream_abort_and_free_blocks(engines, prompt_ids):
    aggregated = engines[0]
    context = RequestContext("cancelled")
    seen = []
    async for out in aggregated.generate(request("cancelled", prompt_ids[3], max_tokens=200), context):
        seen.append(out)
        if len(seen) == 2:
            context.cancel()
    assert seen[-1].finish_reason == "abort" and len(seen) < 10

    stream = aggregated.generate(request("closed", prompt_ids[2], max_tokens=200), RequestContext("closed"))
    async for _ in stream:
        break
    await stream.aclose()
    await wait_idle(aggregated)


async def test_prefill_to_decode_handoff_matches_aggregated(engines, prompt_ids):
    aggregated, prefill, decode, loader = engines
    bs = prefill.config.block_size
    for i, ids in enumerate(prompt_ids[1:]):
        expected = tokens_of(await collect(aggregated, request(f"agg{i}", ids)))
        (done,) = await collect(prefill, request(f"pre{i}", ids))
        assert done.finish_reason == "prefill_done" and done.token_ids == expected[:1]
        handoff = done.handoff
        assert handoff.num_tokens == len(ids) and len(handoff.block_ids) == -(-len(ids) // bs)
        assert prefill.stats.num_held == 1

        decode.drain_kv_events()
        outs = await collect(decode, request(f"dec{i}", ids, handoff=handoff, first_token_id=done.token_ids[0]))
        assert tokens_of(outs) == expected, "decode streams the whole completion, first token included"
        assert outs[-1].usage.completion_tokens == 12
        stored = [h for e in decode.drain_kv_events() if isinstance(e, BlockStored) for h in e.block_hashes]
        assert stored[: len(ids) // bs] == block_hashes(ids, bs), "imported full blocks enter the prefix cache"

        # The same prompt again: the decode side already holds its full blocks.
        again = await collect(decode, request(f"dec{i}-again", ids, handoff=handoff,
                                              first_token_id=done.token_ids[0]))
        assert tokens_of(again) == expected
        assert loader.calls[-1][1] == len(ids) // bs
        assert again[-1].usage.cached_tokens == len(ids) // bs * bs

        await prefill.release_handoff(handoff.request_id)
        await wait_idle(prefill)
        await wait_idle(decode)


async def test_handoff_lease_expires(engines, prompt_ids):
    prefill = engines[1]
    before = prefill.stats.handoff_expiries
    prefill.config.handoff = HandoffTimes(lease_s=0.1, transfer_timeout_s=0.05)
    try:
        (done,) = await collect(prefill, request("leased", prompt_ids[2]))
        assert done.handoff is not None
        await wait_idle(prefill, timeout=5)
    finally:
        prefill.config.handoff = HandoffTimes()
    assert prefill.stats.handoff_expiries == before + 1
    await prefill.release_handoff("leased")  # after expiry: a no-op, not an error


async def test_failed_kv_load_ends_with_error_and_frees_blocks(engines, prompt_ids):
    _, prefill, decode, loader = engines
    (done,) = await collect(prefill, request("pre-fail", prompt_ids[1]))
    handoff = done.handoff
    loader.unreachable.add(handoff.request_id)
    outs = await collect(decode, request("dec-fail", prompt_ids[1], handoff=handoff, first_token_id=done.token_ids[0]))
    assert outs[-1].finish_reason == "error" and "unreachable" in outs[-1].error
    await prefill.release_handoff("pre-fail")
    await wait_idle(decode)
    await wait_idle(prefill)


async def test_decode_without_handoff_prefills_locally(engines, prompt_ids):
    aggregated, _, decode, _ = engines
    expected = tokens_of(await collect(aggregated, request("agg-local", prompt_ids[2])))
    assert tokens_of(await collect(decode, request("dec-local", prompt_ids[2]))) == expected
    await wait_idle(decode)


async def test_decode_rejects_inconsistent_handoff(engines, prompt_ids):
    _, prefill, decode, _ = engines
    (done,) = await collect(prefill, request("pre-bad", prompt_ids[1]))
    try:
        with pytest.raises(InvalidRequestError, match="handoff holds"):
            await collect(decode, request("dec-bad", prompt_ids[1][:-1], handoff=done.handoff,
                                          first_token_id=done.token_ids[0]))
        with pytest.raises(InvalidRequestError, match="first_token_id"):
            await collect(decode, request("dec-bad", prompt_ids[1], handoff=done.handoff))
    finally:
        await prefill.release_handoff("pre-bad")
    await wait_idle(prefill)
