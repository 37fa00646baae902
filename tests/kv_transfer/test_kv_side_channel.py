"""The side channel stays up and fair under bad or slow traffic, and trusts no peer-chosen duration."""

import asyncio
import threading
import time

import msgspec
import pytest
import zmq
import zmq.asyncio
from kv_peer import filled_memory, make_layout

from kv_transfer import KVMemory, KVTransferAgent, TransferConfig, TransferError
from kv_transfer.protocol import Begin, Fetch, Finish, GetMetadata, Reply, Reserve, Write, raise_for
from kv_transfer.side_channel import SideChannelClient, SideChannelServer
from tests.waits import until


async def blocking_server():
    """A server whose Fetch answers wait for `gate`: a bulk copy that takes as long as the test likes
    (`server.fetching` is set once one started)."""
    gate, fetching = asyncio.Event(), asyncio.Event()

    async def handle(request, frames, send) -> Reply:
        if isinstance(request, Fetch):
            fetching.set()
            await gate.wait()
        return Reply(True, message=type(request).__name__)

    server = SideChannelServer("tcp://127.0.0.1:0", handle)
    server.start()
    server.fetching = fetching
    return server, gate


async def test_a_malformed_message_is_counted_and_dropped():
    server, _ = await blocking_server()
    client = SideChannelClient()
    raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.endpoint)
    try:
        await raw.send_multipart([b"one frame"])  # no call id, no body: before, it killed the server task
        await until(lambda: server.malformed == 1, "the malformed message counted")
        await raw.send_multipart([b"id", b"not msgpack"])
        assert (await raw.recv_multipart())[1] == b"R"  # answered as a bad request
        assert server.malformed == 2
        assert (await client.call(server.endpoint, GetMetadata(), 5.0)).message == "GetMetadata"
    finally:
        raw.close(linger=0)
        await client.close()
        await server.close()


async def test_a_call_cancelled_as_its_reply_arrives_is_cancelled():
    """The reply is queued and its caller cancelled in one turn of the loop (a decode request cancelled as its
    Reserve was answered): the call raises CancelledError. Python 3.11's asyncio.wait_for returned the reply
    and dropped the cancellation, and the cancelled request's blocks waited for a push until their lease."""
    server, _ = await blocking_server()
    client = SideChannelClient()
    caller: asyncio.Task | None = None

    class CancelOnReply(dict):
        """The client's calls by id; the reader task's put of a reply also cancels the caller."""

        def get(self, call_id):
            queue = super().get(call_id)

            class Queue:
                def put_nowait(self, item) -> None:
                    queue.put_nowait(item)
                    caller.cancel()

            return None if queue is None else Queue()

    client._calls = CancelOnReply()
    try:
        caller = asyncio.create_task(client.call(server.endpoint, GetMetadata(), 5.0))
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert caller.cancelled()
    finally:
        await client.close()
        await server.close()


async def test_control_messages_do_not_wait_behind_a_bulk_copy():
    server, gate = await blocking_server()
    client = SideChannelClient()
    try:
        copy = asyncio.create_task(client.call(server.endpoint, Fetch("r", [1]), 10.0))
        await asyncio.wait_for(server.fetching.wait(), 5)
        # answered while the Fetch still runs (served one at a time, it waited out its timeout)
        assert (await client.call(server.endpoint, Finish("r", True), 5.0)).message == "Finish"
        assert not copy.done()
        gate.set()
        assert (await copy).message == "Fetch"
    finally:
        await client.close()
        await server.close()


async def test_forgetting_a_peer_fails_only_the_failed_call():
    """forget() after one call failed: another call in flight on the same connection still gets its
    answer, and the next call gets a fresh connection."""
    server, gate = await blocking_server()
    client = SideChannelClient()
    try:
        in_flight = asyncio.create_task(client.call(server.endpoint, Fetch("r", [1]), 10.0))
        await asyncio.wait_for(server.fetching.wait(), 5)
        client.forget(server.endpoint)
        assert client.connections() == 0
        assert (await client.call(server.endpoint, GetMetadata(), 5.0)).ok
        gate.set()
        assert (await in_flight).message == "Fetch"
    finally:
        await client.close()
        await server.close()


async def test_idle_connections_are_pruned(monkeypatch):
    monkeypatch.setattr("kv_transfer.side_channel.MAX_IDLE", 2)
    servers = [(await blocking_server())[0] for _ in range(4)]
    client = SideChannelClient()
    try:
        for server in servers + servers[:1]:  # the first again: pruned, it reconnects
            assert (await client.call(server.endpoint, GetMetadata(), 5.0)).ok
            assert client.connections() <= 2
    finally:
        await client.close()
        for server in servers:
            await server.close()


async def test_a_peers_begin_timeout_is_capped_by_ours():
    released = asyncio.Event()
    config = TransferConfig("zmq", timeout_s=0.2, lease_s=60)
    async with KVTransferAgent("p", filled_memory(make_layout("native", 16), 1), config) as agent:
        desc = agent.hold("r", [1], 10, lambda rid, why, _: why.value == "expired" and released.set())
        client = SideChannelClient()
        try:
            assert (await client.call(agent.endpoint, Begin("r", desc.compat_hash, 1e9), 5.0)).ok
        finally:
            await client.close()
        await asyncio.wait_for(released.wait(), 10)  # after 2 x 0.2 s, not 1e9 s
        assert agent.holding() == []


async def test_reserve_is_checked_and_kept_no_longer_than_our_bound():
    layout = make_layout("native", 16)
    async with KVTransferAgent("p", KVMemory.allocate(layout), TransferConfig("inproc", reserve_s=0.1)) as p, \
            KVTransferAgent("d", KVMemory.allocate(layout), TransferConfig("inproc")) as d:
        target = d.hold("room", [5], 10, lambda *a: None, writable=True, lease_s=1e9)
        client = SideChannelClient()
        try:
            for forged in (msgspec.structs.replace(target, request_id="other"),
                           msgspec.structs.replace(target, writable=False)):
                with pytest.raises(TransferError, match="no writable target"):
                    raise_for(await client.call(p.endpoint, Reserve("room", forged), 5.0))
        finally:
            await client.close()
        await d.reserve(p.endpoint, target)  # the peer's lease says 1e9 s; ours keeps it 0.1 s
        deadline = time.monotonic() + 10
        while True:  # once it expired unclaimed, the room is free again
            try:
                await d.reserve(p.endpoint, target)
                break
            except TransferError as e:
                assert "already reserved" in str(e) and time.monotonic() < deadline, e
                await asyncio.sleep(0.02)
        d.release("room")


async def test_finish_during_a_write_releases_the_blocks_only_after_it():
    """A peer gives up (Finish ok=False) while its Write is still being copied in: the Finish is
    answered at once, the blocks are released when the copy is done, not before."""
    writing, proceed = threading.Event(), threading.Event()
    layout = make_layout("native", 16)
    calls = []
    async with KVTransferAgent("d", KVMemory.allocate(layout), TransferConfig("zmq")) as agent:
        desc = agent.hold("r", [3], 10, lambda rid, why, _: calls.append(why.value), writable=True)
        original = agent._copy

        async def slow_copy(*args):
            await asyncio.to_thread(lambda: (writing.set(), proceed.wait(10)))
            return await original(*args)

        agent._copy = slow_copy
        client = SideChannelClient()
        try:
            assert (await client.call(agent.endpoint, Begin("r", desc.compat_hash, 5.0), 5.0)).ok
            frames = [bytes(layout.block_bytes)]
            write = asyncio.create_task(client.call(agent.endpoint, Write("r", [3]), 10.0, frames=frames))
            await asyncio.wait_for(asyncio.to_thread(writing.wait, 10), 15)
            assert (await client.call(agent.endpoint, Finish("r", False, "gave up"), 5.0)).ok
            assert calls == [] and agent.holding() == []  # ended, but the copy still holds the blocks
            proceed.set()
            assert (await write).ok
            assert calls == ["error"]
        finally:
            proceed.set()
            await client.close()
