"""Failures end cleanly: a typed error on the initiator and every held block released on the holder."""

import asyncio
import sys
import time

import msgspec
import pytest
import torch
from tests.kv_transfer.cases import needs_nixl
from kv_peer import Peer, filled_memory, make_config, make_layout, token_stream

from kv_transfer import (
    BlocksFreedError, CompatError, KVMemory, KVTransferAgent, LeaseExpiredError, PeerLostError, TransferConfig,
    TransferError,
)
from kv_transfer.protocol import Begin, Finish
from kv_transfer.side_channel import SideChannelClient

PEER_KINDS = ["zmq-tcp", pytest.param("nixl", marks=[pytest.mark.nixl, needs_nixl])]


@pytest.fixture(scope="module", params=PEER_KINDS)
def peer(request, ipc_dir):
    """A holder shared by the tests that leave it alive (each uses its own request ids)."""
    peer = Peer(make_config(request.param, "peer", ipc_dir, lease_s=5.0), make_layout("native", 16), seed=3)
    peer.kind = request.param
    yield peer
    peer.close()


def releases(peer, rid: str) -> list[str]:
    return [why for r, why in peer.call("releases") if r == rid]


def decoder(peer, layout=None, **overrides) -> KVTransferAgent:
    layout = layout or make_layout("vllm", 16)
    return KVTransferAgent(
        "decode", KVMemory.allocate(layout), make_config(peer.kind, "decode", timeout_s=3.0, **overrides)
    )


@pytest.mark.parametrize("kind", PEER_KINDS)
async def test_prefill_killed_mid_stream_of_pulls(kind, ipc_dir):
    """Kill the holder while pulls run back to back: completed pulls are intact, the one in flight
    raises PeerLostError, a later pull of a live-looking descriptor too; nothing hangs."""
    peer = Peer(make_config(kind, "doomed", ipc_dir), make_layout("native", 16), seed=3)
    peer.kind = kind
    try:
        blocks = list(range(0, 64, 2))
        descs = [peer.hold(f"stream-{i}", blocks, 16 * len(blocks)) for i in range(40)]
        expected = token_stream(filled_memory(make_layout("native", 16), 3), blocks, 16 * len(blocks))
        async with decoder(peer, make_layout("native", 16)) as agent:
            async def pull_all() -> None:
                for desc in descs[:-1]:
                    await agent.pull(desc, list(range(32)))
                    assert torch.equal(token_stream(agent.memory, list(range(32)), 16 * 32), expected)

            task = asyncio.create_task(pull_all())
            async with asyncio.timeout(30):
                while agent.memory.buffers[0].abs().sum() == 0 and not task.done():  # the first pull landed
                    await asyncio.sleep(0.001)
            assert not task.done() or task.exception() is None, task.exception()
            await asyncio.to_thread(peer.kill)
            with pytest.raises(PeerLostError):
                await asyncio.wait_for(task, 30)
            with pytest.raises(PeerLostError):  # a bound on hanging, not a speed check
                await asyncio.wait_for(agent.pull(descs[-1], list(range(32))), 10)
            assert agent.holding() == []
    finally:
        peer.close()


async def test_decode_dies_mid_transfer_and_the_lease_frees_the_blocks(ipc_dir):
    """We hold; the decode process pins the hold (Begin) and dies before Finish."""
    released = []
    config = make_config("zmq-tcp", "prefill", timeout_s=0.5, lease_s=30)
    async with KVTransferAgent("prefill", filled_memory(make_layout("native", 16), 1), config) as agent:
        desc = agent.hold("orphan", [4, 5], 20, lambda rid, why, _: released.append(why.value))
        decode = Peer(make_config("zmq-tcp", "decode"), make_layout("native", 16), seed=2)
        try:
            assert await asyncio.to_thread(decode.call, "begin_then_hang", msgspec.msgpack.encode(desc)) == "pinned"
            decode.kill()
            deadline = time.monotonic() + 10
            while not released and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        finally:
            decode.close()
        assert released == ["expired"] and agent.holding() == []


async def test_lease_runs_out(peer):
    desc = peer.hold("slow", [1, 2], 32, lease_s=0.2)
    await asyncio.sleep(0.5)
    async with decoder(peer) as agent:
        with pytest.raises(LeaseExpiredError):
            await agent.pull(desc, [5, 6])
    assert releases(peer, "slow") == ["expired"] and "slow" not in peer.call("holding")


async def test_holder_refuses_an_expired_lease_even_if_the_descriptor_says_otherwise():
    async with KVTransferAgent("p", KVMemory.allocate(make_layout("native", 16)), TransferConfig("inproc")) as p, \
            KVTransferAgent("d", KVMemory.allocate(make_layout("native", 16)), TransferConfig("inproc")) as d:
        desc = p.hold("r", [1], 10, lambda *a: None, lease_s=0.05)
        await asyncio.sleep(0.2)
        forged = msgspec.structs.replace(desc, lease_deadline=time.time() + 60)  # a skewed clock
        with pytest.raises(LeaseExpiredError):
            await d.pull(forged, [3])


async def test_compat_mismatch_is_refused_before_bytes_move_and_frees_the_holder(peer):
    desc = peer.hold("other-model", [1, 2], 32)
    async with decoder(peer, make_layout("vllm", 16, model="another-model")) as agent:
        with pytest.raises(CompatError, match="incompatible"):
            await agent.pull(desc, [5, 6])
        assert agent.memory.buffers[0].abs().sum() == 0
    assert releases(peer, "other-model") == ["error"] and "other-model" not in peer.call("holding")


async def test_descriptor_for_blocks_already_freed(peer):
    desc = peer.hold("once", [1, 2], 32)
    async with decoder(peer) as agent:
        await agent.pull(desc, [5, 6])
        with pytest.raises(BlocksFreedError, match="ended"):
            await agent.pull(desc, [5, 6])
        desc2 = peer.hold("aborted", [3], 16)
        assert peer.call("release", "aborted") is True
        with pytest.raises(BlocksFreedError, match="cancelled"):
            await agent.pull(desc2, [7])
    assert releases(peer, "once") == ["done"] and releases(peer, "aborted") == ["cancelled"]


async def test_wrong_block_count_is_a_clear_error_and_frees_the_holder(peer):
    desc = peer.hold("bad", [1, 2, 3], 40)
    async with decoder(peer) as agent:
        with pytest.raises(ValueError, match="3 blocks for 40 tokens"):
            await agent.pull(desc, [5])
    assert releases(peer, "bad") == ["error"]


# -- in one process -------------------------------------------------------------------------


def inproc_pair(prefill_layout=None, decode_layout=None):
    p = KVTransferAgent("p", filled_memory(prefill_layout or make_layout("native", 16), 4), TransferConfig("inproc"))
    d = KVTransferAgent("d", KVMemory.allocate(decode_layout or make_layout("vllm", 8)), TransferConfig("inproc"))
    return p, d


async def test_release_fires_exactly_once_whatever_races():
    p, d = inproc_pair()
    calls = []
    async with p, d:
        desc = p.hold("r", [1, 2], 20, lambda rid, why, _: calls.append(why.value), lease_s=0.05)
        assert p.release("r") is True
        assert p.release("r") is False
        await asyncio.sleep(0.15)  # the lease would have expired by now
        with pytest.raises(BlocksFreedError, match="cancelled"):
            await d.pull(msgspec.structs.replace(desc, lease_deadline=time.time() + 60), [0, 1, 2])
    assert calls == ["cancelled"]


async def test_cancel_during_transfer_waits_for_the_peer_then_refuses():
    p, d = inproc_pair()
    calls = []
    async with p, d:
        desc = p.hold("r", [1, 2], 20, lambda rid, why, _: calls.append(why.value))
        client = SideChannelClient()
        try:
            assert (await client.call(p.endpoint, Begin("r", desc.compat_hash, 5.0), 5.0)).ok
            assert p.release("r") is True and calls == []  # blocks stay while the peer may read
            reply = await client.call(p.endpoint, Finish("r", True), 5.0)
        finally:
            await client.close()
        assert reply.error == "freed" and calls == ["cancelled"] and p.holding() == []


@pytest.mark.parametrize("at", [Begin, Finish])
async def test_a_reader_cancelled_with_its_call_in_flight_unpins_the_hold_at_once(at):
    """The decode side's pull is cancelled (its client went away) after the holder took its Begin (or
    its last Finish) and before the reply came back: the holder learns it now, so its blocks are
    freed at once, not at the pin's deadline (transfer timeout twice over)."""
    p, d = inproc_pair()
    calls = []
    handle = p._handle

    async def cancel_the_reader_on(request, frames, send):
        reply = await handle(request, frames, send)
        if isinstance(request, at) and request.request_id == "r":
            pulling.cancel()  # the reply is not yet sent: the reader is inside its call
        return reply

    p._handle = cancel_the_reader_on
    async with p, d:
        desc = p.hold("r", [1, 2], 20, lambda rid, why, _: calls.append(why.value))
        pulling = asyncio.create_task(d.pull(desc, [0, 1, 2]))
        with pytest.raises(asyncio.CancelledError):
            await pulling
        assert p.holding() == [] and calls == ["done" if at is Finish else "error"]


async def test_push_rendezvous_failures_are_named_and_free_the_reserved_blocks():
    """No Reserve in time (and a late one refused), a second Reserve for the same room, a push that
    cannot fit: each is a clear error, and the decode side's reserved blocks are released (ERROR)
    when the push fails."""
    p, d = inproc_pair(decode_layout=make_layout("native", 16))
    calls = []
    async with p, d:
        with pytest.raises(PeerLostError, match="no decode side reserved blocks for 'late'"):
            await p.wait_push_target("late", timeout_s=0.05)
        late = d.hold("late", [7], 10, lambda *a: None, writable=True)
        with pytest.raises(LeaseExpiredError, match="stopped waiting to push 'late'"):
            await d.reserve(p.endpoint, late)  # refused at once, so the decode side need not wait out its lease
        d.release("late")
        target = d.hold("room", [5, 6], 20, lambda rid, why, payload: calls.append((why.value, payload)),
                        writable=True)
        await d.reserve(p.endpoint, target)
        with pytest.raises(TransferError, match="already reserved"):
            await d.reserve(p.endpoint, target)
        got = await p.wait_push_target("room", timeout_s=1)
        with pytest.raises(ValueError, match="local blocks"):
            await p.push(got, [1], payload=b"never")  # 20 tokens need 2 blocks
        assert calls == [("error", b"")] and d.holding() == []


async def test_inproc_merges_two_tensor_parallel_ranks():
    full = filled_memory(make_layout("native", 16), 8)
    ranks = []
    for r in range(2):
        rank = KVMemory.allocate(make_layout("vllm", 16, num_kv_heads=2, head_offset=2 * r))
        for layer in range(rank.layout.num_layers):
            rank.layer_view(layer).copy_(full.layer_view(layer)[:, :, :, 2 * r : 2 * r + 2])
        ranks.append(KVTransferAgent(f"rank{r}", rank, TransferConfig("inproc")))
    decode = KVTransferAgent("merged", KVMemory.allocate(make_layout("trtllm", 32)), TransferConfig("inproc"))
    async with ranks[0], ranks[1], decode:
        for rank in ranks:  # one pull per source rank; each fills its two heads
            await decode.pull(rank.hold("r", [3, 4, 5], 40, lambda *a: None), [10, 11])
        assert torch.equal(token_stream(decode.memory, [10, 11], 40), token_stream(full, [3, 4, 5], 40))


async def test_transport_mismatch_and_bad_holds_are_named():
    p, d = inproc_pair()
    async with p, d:
        with pytest.raises(ValueError, match="do not match"):
            p.hold("r", [1], 40, lambda *a: None)
        with pytest.raises(ValueError, match="block id outside"):
            p.hold("r", [999], 10, lambda *a: None)
        desc = p.hold("r", [1], 10, lambda *a: None)
        with pytest.raises(ValueError, match="already holds"):
            p.hold("r", [2], 10, lambda *a: None)
        with pytest.raises(TransferError, match="descriptor uses zmq"):
            await d.pull(msgspec.structs.replace(desc, transport="zmq"), [0, 1])
        with pytest.raises(ValueError, match="push target"):
            await d.pull(msgspec.structs.replace(desc, writable=True), [0, 1])


def test_missing_nixl_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl._api", None)  # what an environment without nixl looks like
    memory = KVMemory.allocate(make_layout("native", 16))
    with pytest.raises(ImportError, match=r"pip install --no-deps nixl==1\.5\.1 nixl-cu12==1\.5\.1"):
        KVTransferAgent("x", memory, TransferConfig("nixl"))


def test_unknown_transport_is_named():
    with pytest.raises(ValueError, match="unknown KV transport 'rdma'"):
        TransferConfig("rdma")
