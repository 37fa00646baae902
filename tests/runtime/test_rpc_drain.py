"""RpcServer.drain on real sockets: open streams finish, new ones are refused with WorkerDrainingError,
and the drain timeout ends the rest with WorkerDrainingError, their handlers cancelled."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from dynamo_pd.runtime import RequestContext
from dynamo_pd.runtime.errors import WorkerDrainingError
from dynamo_pd.runtime.rpc_client import RpcClient
from dynamo_pd.runtime.rpc_server import RpcServer
from tests.runtime.test_rpc import Worker
from tests.waits import until


async def collect(client: RpcClient, endpoint: str, payload: bytes, rid: str) -> bytes:
    return b"".join([chunk async for chunk in client.stream(endpoint, payload, RequestContext(rid))])


def held_after_the_first_byte(worker: Worker, gate: asyncio.Event):
    """`worker`'s handler, each stream held after its first byte until `gate` is set: open for as long
    as the test needs, whatever the machine's speed."""
    async def handler(payload: bytes, context: RequestContext):
        async with contextlib.aclosing(worker.handler(payload, context)) as chunks:
            async for chunk in chunks:
                yield chunk
                await gate.wait()

    return handler


async def test_a_drain_lets_open_streams_finish_and_refuses_new_ones():
    worker, gate = Worker(), asyncio.Event()
    client = RpcClient()
    async with RpcServer(held_after_the_first_byte(worker, gate)) as server:
        running = asyncio.create_task(collect(client, server.endpoint, b"x" * 20, "old"))
        await until(lambda: "old" in worker.started)
        drain = asyncio.create_task(server.drain(timeout_s=10.0))
        await until(lambda: server._draining)
        with pytest.raises(WorkerDrainingError, match="takes no new requests"):
            await asyncio.wait_for(collect(client, server.endpoint, b"abc", "new"), 10)
        assert not running.done() and not drain.done()  # "old" is still open: the drain waits for it
        gate.set()
        assert await asyncio.wait_for(running, 10) == b"x" * 20
        assert await asyncio.wait_for(drain, 10) == 0
        assert "new" not in worker.started and worker.ended["old"] == "done"
    await client.close()


async def test_the_drain_timeout_ends_the_rest_with_a_draining_error_and_cancels_their_handlers():
    worker = Worker(delay_s=0.05)
    client = RpcClient()
    async with RpcServer(worker.handler) as server:
        received = []

        async def consume() -> None:
            async for chunk in client.stream(server.endpoint, b"y" * 1000, RequestContext("long")):
                received.append(chunk)

        running = asyncio.create_task(consume())
        await until(lambda: received)
        assert await asyncio.wait_for(server.drain(timeout_s=0.2), 10) == 1
        with pytest.raises(WorkerDrainingError, match="drain timeout"):
            await asyncio.wait_for(running, 10)
        assert await worker.wait_ended("long") == "cancelled"
        assert 0 < len(received) < 1000 and server.num_streams == 0
    await client.close()
