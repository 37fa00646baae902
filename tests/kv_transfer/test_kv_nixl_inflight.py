"""NIXL: blocks a transfer may still write go back to their owner only once it is known to have ended.

The peer process is stopped (SIGSTOP) right after the reader connected, so its READ stays in flight:
over UCX's TCP transport a READ needs the peer's progress. Releasing such a transfer's handle does
not stop it (the bytes land when the peer resumes), nor does removing the peer's agent.
"""

import asyncio
import os
import signal

import pytest
import torch
from tests.kv_transfer.cases import needs_nixl
from tests.waits import until
from kv_peer import Peer, filled_memory, make_config, make_layout, token_stream

from kv_transfer import KVMemory, KVTransferAgent, PeerLostError

pytestmark = [pytest.mark.nixl, needs_nixl]
BLOCKS = list(range(32))
TOKENS = 16 * len(BLOCKS)


@pytest.fixture
def stoppable_peer(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")  # both processes: one-sided over shared memory would not wait
    peer = Peer(make_config("nixl", "peer", lease_s=60), make_layout("native", 16), seed=5)
    yield peer
    os.kill(peer.process.pid, signal.SIGCONT)
    peer.close()


def expected() -> torch.Tensor:
    return token_stream(filled_memory(make_layout("native", 16), 5), BLOCKS, TOKENS)


async def start_stalled_pull(agent: KVTransferAgent, peer: Peer, rid: str, local: list[int]) -> asyncio.Task:
    """A pull whose READ is posted to a stopped peer; returns once it is in flight."""
    desc = peer.hold(rid, BLOCKS, TOKENS)
    connect, stalled = agent.transport._connect, asyncio.Event()

    async def connect_then_stop(d, timeout):
        name = await connect(d, timeout)
        os.kill(peer.process.pid, signal.SIGSTOP)
        stalled.set()
        return name

    agent.transport._connect = connect_then_stop
    task = asyncio.create_task(agent.pull(desc, local))
    await asyncio.wait_for(stalled.wait(), 30)
    await until(lambda: agent.transport._active)  # counted as the READ is posted: the pull polls it
    agent.transport._connect = connect
    return task


async def test_a_pull_cancelled_mid_transfer_returns_its_blocks_only_once_the_read_ended(stoppable_peer):
    async with KVTransferAgent("decode", KVMemory.allocate(make_layout("native", 16)),
                               make_config("nixl", "decode", timeout_s=30)) as agent:
        task = await start_stalled_pull(agent, stoppable_peer, "cancelled", BLOCKS)
        task.cancel()
        os.kill(stoppable_peer.process.pid, signal.SIGCONT)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 60)
        # The caller may reuse the blocks now: nothing is still on its way into them. (Before, the
        # handle was released and the pull ended at once; the bytes landed later, in reused blocks.)
        assert torch.equal(token_stream(agent.memory, BLOCKS, TOKENS), expected())
        assert agent.transport.torn_down == 0
    assert ("cancelled", "error") in await asyncio.to_thread(stoppable_peer.call, "releases")


async def test_forgetting_a_peer_does_not_blind_its_transfers_in_flight(stoppable_peer):
    """Another transfer to the peer failed (_forget): the READ in flight still completes and is seen
    to (before, NIXL reported it failed while its bytes still landed)."""
    async with KVTransferAgent("decode", KVMemory.allocate(make_layout("native", 16)),
                               make_config("nixl", "decode", timeout_s=30)) as agent:
        task = await start_stalled_pull(agent, stoppable_peer, "shared", BLOCKS)
        peer_name = next(iter(agent.transport._peers))
        agent.transport._forget(peer_name)
        os.kill(stoppable_peer.process.pid, signal.SIGCONT)
        assert await asyncio.wait_for(task, 60) > 0
        assert torch.equal(token_stream(agent.memory, BLOCKS, TOKENS), expected())
        assert peer_name not in agent.transport._peers  # removed once the READ was over


async def test_a_read_that_never_ends_is_stopped_by_destroying_the_nixl_agent(stoppable_peer, caplog):
    """The peer stays stopped past the timeout and the grace after it: the NIXL agent is destroyed
    (and replaced) before the pull raises, so the READ can no longer land once the peer resumes."""
    layout = make_layout("native", 16)
    config = make_config("nixl", "decode", timeout_s=0.5)
    async with KVTransferAgent("decode", KVMemory.allocate(layout), config) as agent:
        stale = list(range(32, 64))
        task = await start_stalled_pull(agent, stoppable_peer, "stuck", stale)
        with pytest.raises(PeerLostError):
            await asyncio.wait_for(task, 60)
        os.kill(stoppable_peer.process.pid, signal.SIGCONT)
        # The fresh agent (same name) works; its progress does not bring the old READ's bytes. (Its own
        # timeout: the just-resumed peer may need more than the 0.5 s this agent gives a stuck READ.)
        assert await agent.pull(stoppable_peer.hold("after", BLOCKS, TOKENS), BLOCKS, timeout_s=30) > 0
        assert torch.equal(token_stream(agent.memory, BLOCKS, TOKENS), expected())
        assert agent.memory.layer_view(0)[:, 32:].abs().sum() == 0  # before: the old READ landed here
        assert agent.transport.torn_down == 1
        assert not [r for r in caplog.records if "still referenced" in r.getMessage()]
