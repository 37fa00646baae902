"""Two real processes move random KV blocks between caches of different layouts, per transport."""

import asyncio
import random

import pytest
import torch
import msgspec
from msgspec import msgpack
from tests.kv_transfer.cases import TRANSPORTS, needs_nixl
from kv_peer import Peer, filled_memory, make_config, make_layout, token_stream

from kv_transfer import KVMemory, KVTransferAgent, TransferConfig

PEER_SEED = 11
PEER_LAYOUT = ("native", 16)  # the native engine's cache, as a prefill worker holds it


@pytest.fixture(scope="module", params=TRANSPORTS)
def peer(request, ipc_dir):
    kind = request.param
    etcd = request.getfixturevalue("etcd_url") if kind == "nixl-etcd" else ""
    peer = Peer(make_config(kind, "peer", ipc_dir, etcd), make_layout(*PEER_LAYOUT), PEER_SEED)
    peer.kind, peer.etcd = kind, etcd
    yield peer
    peer.close()


def local_agent(peer, ipc_dir, layout, name="decode") -> KVTransferAgent:
    return KVTransferAgent(name, KVMemory.allocate(layout), make_config(peer.kind, name, ipc_dir, peer.etcd))


# decode layouts: same format (byte copy), vLLM with smaller blocks, TRT-LLM with bigger blocks
# holding half the KV heads (a TP=2 rank)
DECODE_LAYOUTS = {
    "native16": dict(engine="native", block_size=16),
    "vllm8": dict(engine="vllm", block_size=8),
    "trtllm32-tp2": dict(engine="trtllm", block_size=32, num_kv_heads=2, head_offset=2),
}


@pytest.mark.parametrize("decode", sorted(DECODE_LAYOUTS))
async def test_pull_random_blocks_into_another_layout(peer, ipc_dir, decode):
    rng = random.Random(decode)
    spec = DECODE_LAYOUTS[decode]
    layout = make_layout(spec["engine"], spec["block_size"], spec.get("num_kv_heads", 4), spec.get("head_offset", 0))
    num_tokens = 16 * 20 - 5
    src_blocks = rng.sample(range(40), 16) + [40, 41, 42, 43]  # scattered blocks, then one run
    rid = f"pull-{decode}"
    desc = peer.hold(rid, src_blocks, num_tokens)
    skip = 2  # a prefix hit: the decode side already has 2 blocks
    total = -(-num_tokens // layout.block_size)
    dst_blocks = rng.sample(range(layout.num_blocks), total - skip)
    async with local_agent(peer, ipc_dir, layout) as agent:
        moved = await agent.pull(desc, dst_blocks, skip_prefix_blocks=skip)
        expected_all = token_stream(filled_memory(make_layout(*PEER_LAYOUT), PEER_SEED), src_blocks, num_tokens)
        first = skip * layout.block_size
        got = token_stream(agent.memory, dst_blocks, num_tokens - first)
        h0 = layout.head_offset
        assert torch.equal(got, expected_all[:, :, first:, h0 : h0 + layout.num_kv_heads])
        assert moved > 0
    assert (rid, "done") in peer.call("releases")
    assert rid not in peer.call("holding")


async def test_push_into_blocks_the_decode_reserved(peer, ipc_dir):
    """SGLang style: the peer (decode) reserves blocks and sends us where; we prefill and push."""
    layout = make_layout("vllm", 8)
    source = filled_memory(layout, seed=5)
    num_tokens, cached = 16 * 10 + 3, 2  # the decode side already has 2 blocks of 16
    src_blocks = random.Random(1).sample(range(layout.num_blocks), -(-num_tokens // 8))
    reserved = list(range(50, 50 + 11 - cached))
    desc = peer.hold("push-1", reserved, num_tokens, block_offset=cached, writable=True)
    async with KVTransferAgent("prefill", source, make_config(peer.kind, "prefill", ipc_dir, peer.etcd)) as agent:
        # The prefill starts waiting before the Reserve arrives: the rendezvous works in either order.
        waiting = asyncio.create_task(agent.wait_push_target("push-1", timeout_s=30))
        await asyncio.to_thread(peer.call, "reserve", agent.endpoint, msgpack.encode(desc))
        target = await waiting
        assert target == desc
        await agent.push(target, src_blocks, payload=b"first-token")
    filled = peer.call("tokens", reserved, num_tokens - cached * 16)
    assert torch.equal(filled, token_stream(source, src_blocks, num_tokens)[:, :, cached * 16 :])
    assert ("push-1", "done") in peer.call("releases")
    assert peer.call("payload", "push-1") == b"first-token"


async def test_peer_pulls_from_us(peer, ipc_dir):
    """The other direction of pull: the peer process is the decode side, we hold."""
    layout = make_layout("trtllm", 16)
    memory = filled_memory(layout, seed=9)
    released = []
    async with KVTransferAgent("prefill", memory, make_config(peer.kind, "prefill2", ipc_dir, peer.etcd)) as agent:
        desc = agent.hold("rev-1", [7, 8, 9, 30], 60, lambda rid, why, _: released.append((rid, why.value)))
        moved = await asyncio.to_thread(peer.call, "pull", msgpack.encode(desc), [44, 45, 46, 47], 0)
        assert moved == 4 * layout.block_bytes
        got = await asyncio.to_thread(peer.call, "tokens", [44, 45, 46, 47], 60)
        assert torch.equal(got, token_stream(memory, [7, 8, 9, 30], 60))
        assert released == [("rev-1", "done")] and agent.holding() == []


@pytest.mark.parametrize("kind", ["zmq-tcp", "inproc"])
@pytest.mark.parametrize("pack_below", [0, 1 << 40], ids=["regions", "packed"])
async def test_region_and_packed_copy_paths_agree(monkeypatch, ipc_dir, kind, pack_below):
    """Both ways of moving same-format blocks (zero-copy regions, packed gather/scatter), pull and push."""
    monkeypatch.setattr("kv_transfer.transports.PACK_BELOW", pack_below)
    layout = make_layout("vllm-flashinfer", 16)
    source = filled_memory(layout, seed=21)
    src_blocks, dst_blocks = [3, 4, 5, 6, 20, 9], [30, 31, 40, 41, 42, 0]
    async with KVTransferAgent("a", source, make_config(kind, "a", ipc_dir)) as a, \
            KVTransferAgent("b", KVMemory.allocate(layout), make_config(kind, "b", ipc_dir)) as b:
        await b.pull(a.hold("pull", src_blocks, 90, lambda *x: None), dst_blocks)
        assert torch.equal(token_stream(b.memory, dst_blocks, 90), token_stream(source, src_blocks, 90))
        target = b.hold("push", [50, 51, 52, 53, 54, 55], 96, lambda *x: None, writable=True)
        await a.push(target, src_blocks)
        assert torch.equal(token_stream(b.memory, [50, 51, 52, 53, 54, 55], 96), token_stream(source, src_blocks, 96))


async def test_bfloat16_caches_move_and_convert():
    """The native engine may run bfloat16; same-format and converted pulls keep every bit."""
    kv_cache = torch.randn(4, 2, 16, 16, 4, 16).to(torch.bfloat16)  # the native engine's tensor
    source = KVMemory.native(kv_cache, "smol")
    for engine, block_size in (("native", 16), ("vllm", 8)):
        layout = make_layout(engine, block_size)
        target = KVMemory.allocate(msgspec.structs.replace(layout, dtype="bfloat16"))
        async with KVTransferAgent("p", source, make_config("inproc", "p")) as p, \
                KVTransferAgent("d", target, make_config("inproc", "d")) as d:
            count = -(-40 // block_size)
            await d.pull(p.hold("bf16", [9, 2, 3], 40, lambda *x: None), list(range(count)))
            assert torch.equal(token_stream(target, list(range(count)), 40), token_stream(source, [9, 2, 3], 40))


@pytest.mark.nixl
@needs_nixl
@pytest.mark.parametrize("engine,block_size", [("native", 16), ("vllm", 8)])
async def test_nixl_reads_scattered_blocks_packed_by_the_holder(monkeypatch, engine, block_size):
    """Pack: the holder gathers the blocks into one registered buffer, the reader reads it in one
    descriptor (into its own blocks, or straight into a conversion staging buffer)."""
    monkeypatch.setattr("kv_transfer.nixl_transport.PACK_MIN_REGIONS", 1)
    source = filled_memory(make_layout("native", 16), seed=31)
    layout = make_layout(engine, block_size)
    src_blocks = [40, 3, 17, 8, 9, 61]
    count = -(-90 // block_size)
    async with KVTransferAgent("a", source, TransferConfig("nixl")) as a, \
            KVTransferAgent("b", KVMemory.allocate(layout), TransferConfig("nixl")) as b:
        exposed = []
        expose = a.transport.expose
        monkeypatch.setattr(a.transport, "expose", lambda buffer: exposed.append(buffer) or expose(buffer))
        for attempt in range(2):  # the second one reuses the pooled, re-registered buffers
            dst_blocks = random.Random(attempt).sample(range(layout.num_blocks), count)
            await b.pull(a.hold(f"packed-{attempt}", src_blocks, 90, lambda *x: None), dst_blocks)
            assert torch.equal(token_stream(b.memory, dst_blocks, 90), token_stream(source, src_blocks, 90))
        assert len(exposed) == 2 and a.holding() == []
