"""Peer pull: a worker that lacks a prompt's prefix reads it from the peer that holds it (kv_transfer's
HoldPrefix, then the pull of the P/D hand-off), then computes only the rest. Mocker engines, whose stand-in KV
holds each computed token's id: the puller's blocks show whether the bytes that arrived are the prefix's.
Every way it ends (read, partly cached here, evicted there, refused, the holder killed mid-pull, the puller
gone mid-pull) leaves no block pinned or in use on either side, and a prefix that did not arrive is
computed."""

from __future__ import annotations

import argparse
import asyncio
from types import SimpleNamespace

import msgspec
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dynamo_pd.cli import add_engine_args, engine_config
from dynamo_pd.engines.base import EngineConfig, EngineRole
from dynamo_pd.engines.mocker.engine import FakeClock, MockerEngine
from dynamo_pd.engines.native.core import MAX_PEER_PINS
from dynamo_pd.handoff import HandoffManager, HandoffTimes
from dynamo_pd.protocol import EngineRequest, PeerPrefix, SamplingParams, StopConditions, WorkerInfo
from dynamo_pd.runtime import RequestContext
from dynamo_pd.worker_metrics import WorkerEndpoint
from kv_transfer.agent import KVTransferAgent
from kv_transfer.protocol import HoldPrefix, PeerLostError, TransferDescriptor
from router.hashing import block_hashes
from tests.kv_transfer.kv_peer import Peer, make_layout
from tests.kv_transfer.prefix_holder import PrefixHolder
from tests.waits import until

pytestmark = pytest.mark.slow  # the served model's tokenizer

BS = 16
TIMES = HandoffTimes(lease_s=5.0, transfer_timeout_s=2.0)
PROMPT = [1000 + i for i in range(8 * BS + 3)]  # 8 full blocks and 3 tokens more


def config(**kw) -> EngineConfig:
    return EngineConfig(num_kv_blocks=64, block_size=BS, handoff=TIMES, extra={"speedup": 1000.0}, **kw)


def request(rid: str, peer: PeerPrefix | None = None, ids: list[int] = PROMPT) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=ids, sampling=SamplingParams(temperature=0),
                         stop=StopConditions(max_tokens=4, ignore_eos=True), kv_prefix=peer)


async def run(engine: MockerEngine, req: EngineRequest) -> tuple[list[int], int]:
    """(tokens, cached prompt tokens) of one request run to its end."""
    tokens, cached = [], None
    async for out in engine.generate(req, RequestContext(req.request_id)):
        tokens += out.token_ids
        cached = out.usage.cached_tokens if out.usage else cached
    return tokens, cached


def idle(engine: MockerEngine) -> bool:
    """No block referenced: no request, hold or peer pin keeps one."""
    core = engine._core
    return not core.pins and not core.seqs and not any(core.block_manager.ref_counts)


@pytest.fixture
async def pair():
    """A holder and a puller: mocker engines with their hand-off managers (ZMQ), in this process."""
    sides = []
    for name in ("holder", "puller"):
        engine, manager = MockerEngine(config(), clock=FakeClock()), HandoffManager(name, TIMES, "zmq")
        await engine.start()
        await manager.start(engine, "m")
        sides.append((engine, manager))
    yield sides
    for engine, manager in sides:
        await manager.close()
        await engine.stop()


def peer_of(manager: HandoffManager, num_blocks: int = 8) -> PeerPrefix:
    return PeerPrefix(worker_id=manager.worker_id, endpoint=manager.agent.endpoint, num_blocks=num_blocks)


def peer_metrics(manager: HandoffManager) -> dict[tuple[str, str | None], float]:
    """The worker's /metrics peer-pull series, (name, outcome label) -> value."""
    endpoint = WorkerEndpoint()
    endpoint.add(SimpleNamespace(worker_id=manager.worker_id, ready=True, engine_stats=lambda: None,
                                 transfer_counters=manager.agent.counters))
    return {(sample.name, sample.labels.get("outcome")): sample.value
            for family in text_string_to_metric_families(generate_latest(endpoint.registry).decode())
            for sample in family.samples if "_kv_peer_" in sample.name}


def kv_tokens(engine: MockerEngine, ids: list[int], blocks: int) -> list[int]:
    """The token ids the stand-in KV of the engine's cached blocks for `ids` holds."""
    core = engine._core
    table = [core.block_manager.cached[h] for h in block_hashes(ids, BS)[:blocks]]
    return core.kv_cache[0, 0, table, :, 0, 0].flatten().long().tolist()


async def test_a_prefix_the_peer_holds_is_read_not_computed_and_both_sides_free_everything(pair):
    (holder, held_by), (puller, pulls) = pair
    expected, _ = await run(holder, request("first"))
    tokens, cached = await run(puller, request("pulled", peer_of(held_by)))
    assert tokens == expected and cached == 8 * BS
    assert kv_tokens(puller, PROMPT, 8) == PROMPT[:8 * BS], "the bytes that arrived are the prefix's KV"
    await until(lambda: idle(holder) and idle(puller), "both sides idle")
    peer = pulls.agent.counters().peer
    block_bytes = pulls.agent.memory.layout.block_bytes
    assert (peer.pulled, peer.bytes, peer.refused, peer.failed) == (1, 8 * block_bytes, 0, 0)
    assert held_by.agent.counters().peer.served == 1
    assert puller.stats.fetch.pull_bytes_per_s > 0 and puller.stats.fetch.pull_fixed_s > 0
    pulled = peer_metrics(pulls)  # what the puller's /metrics says of it
    name = "dynamo_pd_worker_kv_peer_"
    assert pulled[name + "pulls_total", "pulled"] == 1 and pulled[name + "pulls_total", "failed"] == 0
    assert pulled[name + "pull_bytes_total", None] == 8 * block_bytes
    assert pulled[name + "pull_seconds_total", None] == peer.seconds > 0
    assert peer_metrics(held_by)[name + "holds_total", "served"] == 1


async def test_blocks_the_puller_has_are_not_read_again(pair):
    (holder, held_by), (puller, pulls) = pair
    await run(holder, request("first"))
    await run(puller, request("local", ids=PROMPT[:3 * BS + 1]))  # the puller caches the first 3 blocks
    tokens, cached = await run(puller, request("pulled", peer_of(held_by)))
    assert cached == 8 * BS
    assert pulls.agent.counters().peer.bytes == 5 * pulls.agent.memory.layout.block_bytes
    assert kv_tokens(puller, PROMPT, 8) == PROMPT[:8 * BS]
    await until(lambda: idle(holder) and idle(puller), "both sides idle")


async def test_a_prefix_evicted_at_the_peer_is_computed_here(pair):
    (holder, held_by), (puller, pulls) = pair
    expected, _ = await run(holder, request("first"))
    holder._core.reset_prefix_cache()  # evicted since the router saw it there (on this loop: no step runs)
    tokens, cached = await run(puller, request("pulled", peer_of(held_by)))
    assert tokens == expected and cached == 0
    assert pulls.agent.counters().peer.failed == 1
    assert kv_tokens(puller, PROMPT, 8) == PROMPT[:8 * BS]
    await until(lambda: idle(holder) and idle(puller), "both sides idle")


async def test_a_busy_holder_refuses_and_the_prefix_is_computed_here(pair):
    (holder, held_by), (puller, pulls) = pair
    expected, _ = await run(holder, request("first"))
    hashes = block_hashes(PROMPT, BS)
    for i in range(MAX_PEER_PINS):  # as many peers reading from it as it serves at once
        assert await holder.pin_prefix(f"other-{i}", hashes)
    tokens, cached = await run(puller, request("pulled", peer_of(held_by)))
    assert tokens == expected and cached == 0
    assert pulls.agent.counters().peer.refused == 1 and held_by.agent.counters().peer.declined == 1
    assert peer_metrics(pulls)["dynamo_pd_worker_kv_peer_pulls_total", "refused"] == 1
    assert peer_metrics(held_by)["dynamo_pd_worker_kv_peer_holds_total", "declined"] == 1
    for i in range(MAX_PEER_PINS):
        holder.unpin_prefix(f"other-{i}")
    await until(lambda: idle(holder) and idle(puller), "both sides idle")


async def test_a_holder_killed_mid_pull_leaves_the_puller_computing_it_with_nothing_leaked(pair, monkeypatch):
    _, (puller, pulls) = pair
    reference = MockerEngine(config(), clock=FakeClock())
    await reference.start()
    expected, _ = await run(reference, request("reference"))
    await reference.stop()
    holder = PrefixHolder(config(), TIMES, request("first"))
    real_pull, pinned = pulls.agent.pull, []

    async def pull_after_the_holder_died(desc, *args, **kwargs):
        pinned.append(desc)  # the holder has pinned the prefix and answered: now it dies
        holder.kill()
        return await real_pull(desc, *args, **kwargs)

    monkeypatch.setattr(pulls.agent, "pull", pull_after_the_holder_died)
    peer = PeerPrefix(worker_id="holder", endpoint=holder.endpoint, num_blocks=8)
    tokens, cached = await run(puller, request("pulled", peer))
    assert pinned and len(pinned[0].block_ids) == 8, "the holder had pinned the prefix"
    assert tokens == expected and cached == 0
    peer = pulls.agent.counters().peer
    assert (peer.pulled, peer.failed) == (0, 1)
    assert pulls.agent.counters().failures["peer_lost"] == 1
    await until(lambda: idle(puller), "the puller idle")
    assert pulls.agent.holding() == []


async def test_a_puller_gone_mid_pull_leaves_no_pin_at_the_holder(pair, ipc_dir):
    (holder, held_by), _ = pair
    await run(holder, request("first"))
    unpinned = asyncio.Event()
    real_unpin = holder.unpin_prefix
    holder.unpin_prefix = lambda pin_id: (real_unpin(pin_id), unpinned.set())
    # the puller's first message, then a process that pins the hold for its read (Begin) and dies
    async with KVTransferAgent("half-puller", pulls_memory(holder)) as asker:
        asked = HoldPrefix("gone@puller", block_hashes(PROMPT, BS))
        reply = await asker._client.call(held_by.agent.endpoint, asked, 5.0)
    desc = msgspec.msgpack.decode(reply.payload, type=TransferDescriptor)
    assert len(desc.block_ids) == 8 and holder._core.pins
    peer = Peer(held_by.agent.config, make_layout("native", BS), seed=1)
    try:
        # off this loop: the holder's side channel answers on it
        assert await asyncio.to_thread(peer.call, "begin_then_hang", msgspec.msgpack.encode(desc)) == "pinned"
        peer.kill()
        # the pinned hold outlives neither the reader's timeout nor the holder's: then it is unpinned
        await asyncio.wait_for(unpinned.wait(), 3 * TIMES.transfer_timeout_s + 5)
    finally:
        peer.kill()
    await until(lambda: idle(holder), "the holder idle")
    assert held_by.agent.holding() == [] and held_by.agent.counters().failures["hold_expired"] == 1


def pulls_memory(engine: MockerEngine):
    from kv_transfer.memory import KVMemory

    return KVMemory.native(engine.kv_cache.clone(), "m")


async def test_a_dead_peer_endpoint_is_a_peer_lost_error_not_a_hang(pair):
    _, (puller, pulls) = pair
    with pytest.raises(PeerLostError):
        await pulls.agent.pull_prefix("tcp://127.0.0.1:9", "x", block_hashes(PROMPT, BS), list(range(8)),
                                      timeout_s=1.0)


async def test_a_worker_started_with_no_peer_prefixes_neither_lends_nor_is_offered_as_a_holder():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    cfg = engine_config(parser.parse_args(["--engine", "mocker", "--no-peer-prefixes"]), EngineRole.AGGREGATED, [])
    assert cfg.peer_prefixes is False
    engine, manager = MockerEngine(config(peer_prefixes=False), clock=FakeClock()), HandoffManager("w", TIMES, "zmq")
    await engine.start()
    await manager.start(engine, "m")
    try:
        assert manager.agent is not None and manager.agent.prefix_source is None
        info = manager.register(WorkerInfo(worker_id="w", role=EngineRole.AGGREGATED, engine="mocker", model="m",
                                           model_path="m", rpc_endpoint=""))
        assert info.kv_peer_prefixes is False  # the router plans no pull from or into it
    finally:
        await manager.close()
        await engine.stop()
