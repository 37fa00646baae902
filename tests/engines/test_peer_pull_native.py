"""Peer pull between two native engines on a real model, over NIXL and over ZMQ: a 2,000-token prefix one
holds is read by the other instead of recomputed, the text is the holder's, and both sides free every
block."""

from __future__ import annotations

import asyncio
import time

import pytest

from dynamo_pd.engines.base import EngineConfig
from dynamo_pd.engines.native.engine import NativeEngine
from dynamo_pd.handoff import HandoffManager, HandoffTimes
from dynamo_pd.protocol import EngineRequest, PeerPrefix, SamplingParams, StopConditions
from dynamo_pd.runtime import RequestContext

pytestmark = pytest.mark.slow

BS = 16
TIMES = HandoffTimes(lease_s=30.0, transfer_timeout_s=30.0)
PROMPT = [(7 * i) % 40000 + 100 for i in range(2000)] + [11, 12, 13]


def request(rid: str, peer: PeerPrefix | None = None) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=PROMPT, sampling=SamplingParams(temperature=0),
                         stop=StopConditions(max_tokens=8, ignore_eos=True), kv_prefix=peer)


async def run(engine: NativeEngine, req: EngineRequest) -> tuple[list[int], int, float]:
    """(tokens, cached prompt tokens, seconds to the first token)."""
    tokens, cached, started, first = [], None, time.perf_counter(), None
    async for out in engine.generate(req, RequestContext(req.request_id)):
        first = first or time.perf_counter() - started
        tokens += out.token_ids
        cached = out.usage.cached_tokens if out.usage else cached
    return tokens, cached, first


async def all_free(engine: NativeEngine, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        s = engine.stats
        if s.num_free_blocks == s.num_total_blocks and s.num_peer_pins == s.num_running == s.num_loading == 0:
            return
        assert time.monotonic() < deadline, f"blocks still in use: {s}"
        await asyncio.sleep(0.05)


async def test_a_2000_token_prefix_pulled_from_a_peer_over_nixl_and_zmq_gives_the_holders_text():
    holder, puller = (NativeEngine(EngineConfig(num_kv_blocks=200, block_size=BS, max_num_batched_tokens=2048,
                                                handoff=TIMES)) for _ in range(2))
    await holder.start()
    await puller.start()
    try:
        expected, _, computed_s = await run(holder, request("computed"))
        for transport in ("zmq", "nixl"):
            held_by = HandoffManager("holder", TIMES, transport)
            pulls = HandoffManager("puller", TIMES, transport)
            await held_by.start(holder, "smol")
            await pulls.start(puller, "smol")
            try:
                peer = PeerPrefix(worker_id="holder", endpoint=held_by.agent.endpoint,
                                  num_blocks=len(PROMPT) // BS)
                tokens, cached, pulled_s = await run(puller, request(f"pulled-{transport}", peer))
                assert tokens == expected, f"{transport}: the holder's text"
                assert cached == len(PROMPT) // BS * BS, f"{transport}: the prefix was read, not computed"
                counters = pulls.agent.counters()
                assert counters.transport == transport and counters.peer.pulled == 1
                assert counters.peer.bytes == len(PROMPT) // BS * pulls.agent.memory.layout.block_bytes
                assert held_by.agent.counters().peer.served == 1
                await all_free(holder)
                await all_free(puller)
                assert held_by.agent.holding() == [] and pulls.agent.holding() == []
                mib = counters.peer.bytes / 2**20
                print(f"\n{transport}: first token {pulled_s:.3f}s after pulling {mib:.0f} MiB in "
                      f"{counters.peer.seconds:.3f}s; computed: {computed_s:.3f}s")
            finally:
                await pulls.close()
                await held_by.close()
            await puller.reset_prefix_cache()  # the next transport pulls it all again
    finally:
        await puller.stop()
        await holder.stop()
