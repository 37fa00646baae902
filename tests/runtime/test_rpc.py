"""Request plane: streaming, remote errors, cancellation reaching the worker, dead workers, concurrency."""

from __future__ import annotations

import asyncio
import socket
import signal

import pytest

from dynamo_pd.runtime import RequestContext
from dynamo_pd.protocol import InvalidRequestError, PromptTooLongError
from dynamo_pd.runtime.errors import (
    FirstResponseTimeoutError,
    RemoteError,
    RequestCancelledError,
    RpcError,
    StreamStalledError,
    WorkerGoneError,
)
from dynamo_pd.runtime.rpc_client import RpcClient
from dynamo_pd.runtime.rpc_server import RpcServer

from tests.servers import free_port


class Worker:
    """A handler that streams `payload` back one byte at a time and records how each request ended."""

    def __init__(self, delay_s: float = 0.0, first_delay_s: float = 0.0):
        self.delay_s = delay_s
        self.first_delay_s = first_delay_s
        self.started: dict[str, RequestContext] = {}
        self.ended: dict[str, str] = {}  # request id -> "done" | "cancelled" | "aborted"
        self.changed = asyncio.Condition()

    async def handler(self, payload: bytes, context: RequestContext):
        self.started[context.request_id] = context
        try:
            await asyncio.sleep(self.first_delay_s)
            for i in range(len(payload)):
                if payload[i:i + 1] == b"!":
                    raise ValueError(f"bad byte at {i}")
                yield payload[i:i + 1]
                await asyncio.sleep(self.delay_s)
            await self._end(context, "done")
        finally:
            if context.request_id not in self.ended:
                await self._end(context, "cancelled" if context.cancelled else "aborted")

    async def _end(self, context: RequestContext, how: str) -> None:
        self.ended[context.request_id] = how
        async with self.changed:
            self.changed.notify_all()

    async def wait_ended(self, request_id: str, timeout_s: float = 10.0) -> str:
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(lambda: request_id in self.ended), timeout_s)
        return self.ended[request_id]


async def collect(client: RpcClient, endpoint: str, payload: bytes, request_id: str) -> bytes:
    return b"".join([c async for c in client.stream(endpoint, payload, RequestContext(request_id))])


async def test_stream_round_trip():
    worker = Worker()
    async with RpcServer(worker.handler) as server:
        client = RpcClient()
        assert server.endpoint.startswith("tcp://127.0.0.1:")
        assert await collect(client, server.endpoint, b"hello world", "r1") == b"hello world"
        assert await collect(client, server.endpoint, b"", "r2") == b""
        assert worker.ended == {"r1": "done", "r2": "done"}
        await client.close()


async def test_handler_error_arrives_typed_with_its_message():
    worker = Worker()
    async with RpcServer(worker.handler) as server:
        client = RpcClient()
        chunks = []
        with pytest.raises(RemoteError, match="bad byte at 2") as info:
            async for chunk in client.stream(server.endpoint, b"ab!c", RequestContext("r1")):
                chunks.append(chunk)
        assert chunks == [b"a", b"b"]
        assert info.value.error_type == "ValueError"
        # The connection stays usable after a remote error.
        assert await collect(client, server.endpoint, b"ok", "r2") == b"ok"
        await client.close()


async def test_hundred_concurrent_streams_share_one_connection():
    worker = Worker(delay_s=0.001)
    async with RpcServer(worker.handler) as server:
        client = RpcClient()
        payloads = [f"stream-{i:03d}-".encode() * 3 for i in range(100)]
        results = await asyncio.gather(*(collect(client, server.endpoint, p, f"r{i}")
                                         for i, p in enumerate(payloads)))
        assert results == payloads
        assert len(client._connections) == 1
        assert set(worker.ended.values()) == {"done"} and len(worker.ended) == 100
        await client.close()


@pytest.mark.parametrize("how", ["context", "aclose", "task"])
async def test_client_cancellation_cancels_the_worker_context(how):
    worker = Worker(delay_s=0.02)
    async with RpcServer(worker.handler) as server:
        client = RpcClient()
        context = RequestContext("r1")
        stream = client.stream(server.endpoint, b"x" * 10_000, context)
        assert await anext(stream) == b"x"
        if how == "context":
            context.cancel()
            with pytest.raises(RequestCancelledError):
                async for _ in stream:
                    pass
        elif how == "aclose":
            await stream.aclose()
        else:
            consuming = asyncio.Event()

            async def consume():
                async for _ in stream:
                    consuming.set()
            consumer = asyncio.create_task(consume())
            await asyncio.wait_for(consuming.wait(), 10)  # cancelled mid-stream, not before it resumes
            consumer.cancel()
            with pytest.raises(asyncio.CancelledError):
                await consumer
        assert await worker.wait_ended("r1") == "cancelled"
        assert worker.started["r1"].cancelled
        async with asyncio.timeout(10):  # the server drops the stream once its handler has ended
            while server.num_streams:
                await asyncio.sleep(0.01)
        await client.close()


async def test_first_response_timeout_cancels_the_work():
    worker = Worker(first_delay_s=30)
    async with RpcServer(worker.handler) as server:
        client = RpcClient(first_response_timeout_s=0.3)
        with pytest.raises(FirstResponseTimeoutError, match="within 0.3s"):
            await collect(client, server.endpoint, b"abc", "slow")
        assert await worker.wait_ended("slow") == "cancelled"
        await client.close()


async def test_no_worker_listening_is_worker_gone_at_once():
    """A refused connection (the worker died; discovery still lists it) fails without waiting out
    the connect timeout, so the caller falls back at once."""
    client = RpcClient(connect_timeout_s=120)
    async with asyncio.timeout(60):
        with pytest.raises(WorkerGoneError, match="refused"):
            await collect(client, f"tcp://127.0.0.1:{free_port()}", b"abc", "r1")
    await client.close()


async def test_a_peer_that_never_speaks_zmq_is_worker_gone_after_the_connect_timeout():
    client = RpcClient(connect_timeout_s=0.5)
    with socket.create_server(("127.0.0.1", 0)) as silent:  # TCP accepts, nobody answers the handshake
        with pytest.raises(WorkerGoneError, match="could not connect"):
            await collect(client, f"tcp://127.0.0.1:{silent.getsockname()[1]}", b"abc", "r1")
    await client.close()


async def test_replies_racing_new_requests_are_never_lost(procs):
    """Regression: requests once went out through a sync shadow of the client's socket, and such a
    send could swallow the edge-triggered wake-up of the pending receive; a reply arriving then was
    never read, and every later stream on that connection timed out."""
    endpoint = await procs.ready(procs.start("echo_server"))
    client = RpcClient(first_response_timeout_s=5)

    async def one(i: int) -> bytes:
        await asyncio.sleep(i % 7 * 0.0003)  # spread the opens over the replies to earlier ones
        return b"".join([c async for c in client.stream(endpoint, b"%d," % i, RequestContext(f"r{i}"))])

    for batch in range(100):
        ids = range(batch * 30, batch * 30 + 30)
        assert await asyncio.gather(*(one(i) for i in ids)) == [b"%d," % i * 3 for i in ids]
    await client.close()


async def test_worker_killed_mid_stream_is_worker_gone(procs):
    proc = procs.start("rpc_server")
    endpoint = await procs.ready(proc)
    client = RpcClient()
    got = []
    with pytest.raises(WorkerGoneError, match="dropped"):
        async for chunk in client.stream(endpoint, b"", RequestContext("r1")):
            got.append(chunk)
            if len(got) == 3:
                proc.kill()  # SIGKILL: no goodbye on the wire
    assert got[:3] == [b"tick"] * 3
    await client.close()


async def test_server_closing_mid_stream_is_worker_gone():
    worker = Worker(delay_s=0.02)
    server = RpcServer(worker.handler)
    await server.start()
    client = RpcClient()
    stream = client.stream(server.endpoint, b"x" * 1000, RequestContext("r1"))
    assert await anext(stream) == b"x"
    await server.close()
    assert await worker.wait_ended("r1") == "cancelled"
    with pytest.raises(WorkerGoneError):
        async for _ in stream:
            pass
    await client.close()


async def test_client_killed_mid_stream_cancels_the_worker_context(procs):
    worker = Worker(delay_s=0.05)
    async with RpcServer(worker.handler, client_timeout_s=3.0) as server:
        proc = procs.start("rpc_client", server.endpoint)
        await procs.ready(proc)
        assert list(worker.started) == ["from-subprocess"]
        proc.kill()
        assert await worker.wait_ended("from-subprocess") == "cancelled"


async def test_frozen_worker_is_worker_gone_after_heartbeat_timeout(procs):
    proc = procs.start("rpc_server")
    endpoint = await procs.ready(proc)
    client = RpcClient(heartbeat_timeout_s=1.5)
    stream = client.stream(endpoint, b"", RequestContext("r1"))
    assert await anext(stream) == b"tick"
    proc.send_signal(signal.SIGSTOP)  # the host vanishes: no FIN, no RST, just silence
    with pytest.raises(WorkerGoneError, match="dropped"):
        async with asyncio.timeout(10):
            async for _ in stream:
                pass
    await client.close()


async def test_frozen_client_has_its_streams_cancelled(procs):
    worker = Worker(delay_s=0.05)
    async with RpcServer(worker.handler, client_timeout_s=2.0) as server:
        proc = procs.start("rpc_client", server.endpoint)
        await procs.ready(proc)
        proc.send_signal(signal.SIGSTOP)
        assert await worker.wait_ended("from-subprocess") == "cancelled"


# ---- error kinds, the inter-response deadline, released connections


async def test_a_refused_request_arrives_as_the_client_error_it_is_not_a_remote_error():
    async def refuse(payload: bytes, context: RequestContext):
        error = PromptTooLongError if payload == b"long" else InvalidRequestError
        raise error(f"refused {payload.decode()}", "prompt")
        yield b""  # an async generator, like every handler

    async with RpcServer(refuse) as server:
        client = RpcClient()
        for payload, error in ((b"bad", InvalidRequestError), (b"long", PromptTooLongError)):
            with pytest.raises(InvalidRequestError) as info:
                await collect(client, server.endpoint, payload, payload.decode())
            assert type(info.value) is error and not isinstance(info.value, RpcError)
            assert (str(info.value), info.value.param) == (f"refused {payload.decode()}", "prompt")
        assert PromptTooLongError.code == "context_length_exceeded"
        await client.close()


async def test_a_stream_silent_after_its_first_response_is_stalled_and_its_work_cancelled():
    wedged = asyncio.Event()  # never set: the engine stops producing after one output
    ended: asyncio.Future = asyncio.get_running_loop().create_future()

    async def one_then_nothing(payload: bytes, context: RequestContext):
        try:
            yield b"first"
            await wedged.wait()
        finally:
            ended.set_result(context.cancelled)

    async with RpcServer(one_then_nothing) as server:
        client = RpcClient(first_response_timeout_s=30, inter_response_timeout_s=0.3)
        chunks = []
        with pytest.raises(StreamStalledError, match="within 0.3s"):
            async for chunk in client.stream(server.endpoint, b"", RequestContext("wedged")):
                chunks.append(chunk)
        assert chunks == [b"first"]
        assert await asyncio.wait_for(ended, 10) is True  # the worker's context was cancelled
        # a stream slower than nothing but faster than the deadline is not cut
        slow = Worker(delay_s=0.05)
        async with RpcServer(slow.handler) as other:
            assert await collect(client, other.endpoint, b"abcdef", "slow") == b"abcdef"
        await client.close()


async def test_a_released_connection_closes_once_its_last_stream_ends():
    """A worker that left discovery: its open stream finishes, then the connection is gone."""
    worker = Worker(delay_s=0.01)
    async with RpcServer(worker.handler) as server:
        client = RpcClient()
        stream = client.stream(server.endpoint, b"x" * 20, RequestContext("r1"))
        assert await anext(stream) == b"x"
        client.release(server.endpoint)
        assert client.num_connections == 1  # still serving r1
        assert b"".join([c async for c in stream]) == b"x" * 19
        assert client.num_connections == 0 and not client._connections
        client.release(server.endpoint)  # idle (or unknown): closed at once, nothing to do
        assert await collect(client, server.endpoint, b"ok", "r2") == b"ok"  # a worker that came back
        client.release(server.endpoint)
        assert client.num_connections == 0 and not client._connections
        await client.close()
