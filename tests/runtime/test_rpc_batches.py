"""Request plane: stream_batches hands a caller every chunk that had arrived when it asked, in order, with
an end or an error after them kept for the next round (a caller behind on a stream sends its backlog at
once)."""

from __future__ import annotations

import asyncio

import pytest

from dynamo_pd.runtime import RequestContext
from dynamo_pd.runtime.errors import RemoteError
from dynamo_pd.runtime.rpc_client import RpcClient
from dynamo_pd.runtime.rpc_server import RpcServer

TIMEOUT_S = 10.0


class Burst:
    """Streams b"a"; once `go` is set, b"b", b"c", b"d" back to back; then ends (or raises, with `fail`)."""

    def __init__(self, fail: bool = False) -> None:
        self.go, self.fail = asyncio.Event(), fail

    async def handler(self, payload: bytes, context: RequestContext):
        yield b"a"
        await self.go.wait()
        for chunk in (b"b", b"c", b"d"):
            yield chunk
        if self.fail:
            raise ValueError("after the burst")


async def arrived(client: RpcClient, endpoint: str, count: int) -> None:
    """Until the stream open on `endpoint` holds `count` undelivered items (chunks, then its end or error)."""
    async def poll() -> None:
        while True:
            inboxes = list(client._connections[endpoint]._streams.values())
            if inboxes and len(inboxes[0].items) >= count:
                return
            await asyncio.sleep(0.01)  # the reader task delivers them: nothing to wait on from here

    await asyncio.wait_for(poll(), TIMEOUT_S)


@pytest.mark.parametrize("fail", [False, True])
async def test_chunks_that_arrived_together_come_as_one_batch_and_the_end_after_them(fail):
    burst = Burst(fail)
    async with RpcServer(burst.handler) as server:
        client = RpcClient()
        try:
            batches = client.stream_batches(server.endpoint, b"", RequestContext("r1"))
            assert await asyncio.wait_for(anext(batches), TIMEOUT_S) == [b"a"]
            burst.go.set()
            await arrived(client, server.endpoint, 4)  # b, c, d and the end or the error
            assert await asyncio.wait_for(anext(batches), TIMEOUT_S) == [b"b", b"c", b"d"]
            with pytest.raises(RemoteError if fail else StopAsyncIteration):
                await asyncio.wait_for(anext(batches), TIMEOUT_S)
        finally:
            await client.close()


async def test_what_one_turn_of_the_worker_produced_for_a_client_is_one_message():
    """An engine step wakes every stream at once; their chunks (and ends) go to the client as one ZMQ message,
    not one each: a send costs far more than its bytes. A raw DEALER counts the messages."""
    import zmq
    import zmq.asyncio

    from dynamo_pd.runtime import rpc_wire as wire

    step = asyncio.Event()

    async def handler(payload: bytes, context: RequestContext):
        await step.wait()
        yield payload

    async with RpcServer(handler) as server:
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(server.endpoint)
        try:
            for stream in range(1, 9):
                await sock.send_multipart([wire.encoder.encode([wire.Open(stream, f"r{stream}")]), b"%d" % stream])
            while server.num_streams < 8:
                await asyncio.sleep(0.01)
            step.set()
            frames = await asyncio.wait_for(sock.recv_multipart(), TIMEOUT_S)
            headers = wire.client_decoder.decode(frames[0])
            assert [type(h) for h in headers] == [wire.Data, wire.End] * 8
            assert [h.stream for h in headers] == [s for s in range(1, 9) for _ in (0, 1)]
            assert frames[1:] == [b"%d" % s for s in range(1, 9)]
        finally:
            sock.close()


async def test_the_requests_a_client_opened_on_a_worker_in_one_turn_are_one_message():
    """The other way: streams opened on one worker in one turn of the client's loop (a burst of requests the
    frontend places there) go as one ZMQ message, each Open's payload a frame after the header. A raw ROUTER
    counts the messages."""
    import zmq
    import zmq.asyncio

    from dynamo_pd.runtime import rpc_wire as wire

    sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    client = RpcClient()
    try:
        endpoint = f"tcp://127.0.0.1:{port}"
        await client._connection(endpoint)  # connected, so the opens below are one turn's
        streams = [client.stream_batches(endpoint, b"p%d" % i, RequestContext(f"r{i}")) for i in range(5)]
        pending = [asyncio.ensure_future(anext(s)) for s in streams]
        frames = await asyncio.wait_for(sock.recv_multipart(), TIMEOUT_S)
        headers = wire.server_decoder.decode(frames[1])
        assert [(type(h), h.request_id) for h in headers] == [(wire.Open, f"r{i}") for i in range(5)]
        assert frames[2:] == [b"p%d" % i for i in range(5)]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for s in streams:
            await s.aclose()
    finally:
        await client.close()
        sock.close()
