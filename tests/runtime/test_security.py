"""With a cluster secret every ZMQ plane refuses peers without it (real sockets); authenticated peers
work; a message over a socket's size limit drops its sender's connection, never the server's task."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from dynamo_pd.runtime import (
    DiscoveryServer, DiscoveryUnavailableError, RequestContext, RpcClient, RpcServer, WorkerGoneError,
    connect_discovery, connect_event_plane,
)
from dynamo_pd.runtime.discovery_embedded import EmbeddedStore
from dynamo_pd.runtime.kv_events import ZmqBatchPublisher, ZmqBatchSource
from dynamo_pd.runtime.security import Security, SecretError
from kv_transfer.protocol import GetMetadata, PeerLostError, Reply
from kv_transfer.side_channel import Plain, SideChannelClient, SideChannelServer

SECRET = "a-cluster-secret-of-32-characters"
OTHER = "another-secret-of-32-characters!"
PLAIN = Security()


async def echo(payload: bytes, context: RequestContext) -> AsyncIterator[bytes]:
    yield payload


async def stranger(security: Security, endpoint: str, frames: list[bytes], wait_s: float = 1.0) -> list[bytes] | None:
    """A CURVE DEALER that knows `security`'s server key but not its client key: what it gets back."""
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.curve_serverkey = security.server_public
    sock.connect(endpoint)
    try:
        try:
            await asyncio.wait_for(sock.send_multipart(frames), wait_s)
        except TimeoutError:
            # Bounded: in CI (2026-11-29) this send never woke up and the test hung until pytest's 300 s timeout;
            # what matters is that nothing comes back, and the handshake has had wait_s to be refused either way.
            return None
        return await sock.recv_multipart() if await sock.poll(wait_s * 1000) else None
    finally:
        sock.close()


def test_a_short_secret_is_refused():
    with pytest.raises(SecretError, match="at least 16 characters"):
        Security("short")


async def test_rpc_refuses_peers_without_the_secret():
    secure = Security(SECRET)
    async with RpcServer(echo, security=secure) as server:
        for other in (PLAIN, Security(OTHER)):
            client = RpcClient(connect_timeout_s=3.0, security=other)
            with pytest.raises(WorkerGoneError):
                async for _ in client.stream(server.endpoint, b"x", RequestContext("r")):
                    pass
            await client.close()
        refused = secure.refused
        assert await stranger(secure, server.endpoint, [b"\x81\xa4type\xa4Ping"]) is None
        assert secure.refused == refused + 1  # the ZAP handler turned it away
        client = RpcClient(security=secure)
        assert [c async for c in client.stream(server.endpoint, b"hello", RequestContext("ok"))] == [b"hello"]
        await client.close()


async def test_discovery_refuses_peers_without_the_secret():
    secure = Security(SECRET)
    async with DiscoveryServer(security=secure) as server:
        for other in (PLAIN, Security(OTHER)):
            store = EmbeddedStore(server.url, request_timeout_s=1.0, security=other)
            with pytest.raises(DiscoveryUnavailableError):
                await store.grant(3.0)
            await store.close()
        refused = secure.refused
        assert await stranger(secure, server.url, [b"\x82\xa4type\xa5Grant\xa3req\x01"]) is None
        assert secure.refused == refused + 1
        async with await connect_discovery(server.url, security=secure) as discovery:
            reg = await discovery.advertise("k", b"v")
            assert await discovery.get_prefix("") == {"k": b"v"}
            await reg.close()


async def test_the_zmq_event_plane_refuses_subscribers_without_the_secret():
    secure = Security(SECRET)
    async with DiscoveryServer(security=secure) as server, \
            await connect_discovery(server.url, security=secure) as discovery:
        publisher = await connect_event_plane(None, discovery, security=secure)
        insider = await connect_event_plane(None, discovery, security=secure)
        outsider = await connect_event_plane(None, discovery, security=PLAIN)  # found the publisher, not let in
        try:
            subs = [await insider.subscribe("load"), await outsider.subscribe("load")]
            async def first(sub):
                while True:  # publish until the subscription is connected (delivery is at most once)
                    await publisher.publish("load.w", b"m")
                    try:
                        return await asyncio.wait_for(anext(sub), 0.2)
                    except asyncio.TimeoutError:
                        continue
            assert await asyncio.wait_for(first(subs[0]), 10) == ("load.w", b"m")
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(first(subs[1]), 2)
        finally:
            for plane in (publisher, insider, outsider):
                await plane.close()


async def test_kv_event_streams_and_their_replay_refuse_readers_without_the_secret():
    secure = Security(SECRET)
    pub = ZmqBatchPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", security=secure)
    outsider = ZmqBatchSource(pub.endpoint, pub.replay_endpoint, replay_timeout_s=1.0, security=PLAIN)
    insider = ZmqBatchSource(pub.endpoint, pub.replay_endpoint, security=secure)
    try:
        await pub.publish(b"batch-0")
        assert await insider.replay(0) == [(0, b"batch-0")]
        assert await outsider.replay(0) is None
        assert await stranger(secure, pub.replay_endpoint, [b"", (0).to_bytes(8, "big")]) is None
        got = None
        for _ in range(50):  # the SUB joins a moment after connecting: publish until it reads (batch-0 may come first)
            await pub.publish(b"live")
            if (got := await insider.next(0.2)) is not None and got[1] == b"live":
                break
        assert got is not None and got[1] == b"live"
        await pub.publish(b"live")
        assert await outsider.next(1.0) is None
    finally:
        for closable in (insider, outsider, pub):
            await closable.close()


async def test_the_kv_side_channel_refuses_peers_without_the_secret():
    secure = Security(SECRET)

    async def handle(request, frames, send) -> Reply:
        return Reply(True, message=type(request).__name__)

    server = SideChannelServer("tcp://127.0.0.1:0", handle, guard=secure)
    server.start()
    try:
        for guard in (Plain(), Security(OTHER)):
            client = SideChannelClient(guard=guard)
            with pytest.raises(PeerLostError):
                await client.call(server.endpoint, GetMetadata(), 1.0)
            await client.close()
        client = SideChannelClient(guard=secure)
        assert (await client.call(server.endpoint, GetMetadata(), 5.0)).message == "GetMetadata"
        await client.close()
    finally:
        await server.close()


@pytest.mark.parametrize("secret", [None, SECRET])
async def test_an_oversized_message_drops_its_sender_not_the_server(monkeypatch, secret):
    monkeypatch.setattr("dynamo_pd.runtime.rpc_server.RPC_MAX_BYTES", 1 << 20)
    monkeypatch.setattr("dynamo_pd.runtime.discovery_server.DISCOVERY_MAX_BYTES", 1 << 20)
    security = Security(secret)
    big = b"x" * (2 << 20)

    async def handle(request, frames, send) -> Reply:
        return Reply(True, message=type(request).__name__)

    side = SideChannelServer("tcp://127.0.0.1:0", handle, max_bytes=1 << 20, guard=security)
    side.start()
    async with RpcServer(echo, security=security) as rpc, DiscoveryServer(security=security) as disco:
        try:
            client = RpcClient(security=security)
            with pytest.raises(WorkerGoneError):  # its connection is dropped
                async for _ in client.stream(rpc.endpoint, big, RequestContext("big")):
                    pass
            assert [c async for c in client.stream(rpc.endpoint, b"small", RequestContext("ok"))] == [b"small"]
            await client.close()

            store = EmbeddedStore(disco.url, request_timeout_s=1.0, security=security)
            with pytest.raises(DiscoveryUnavailableError):  # answered at once ({}) without the limit
                await store.get_prefix(big.decode())
            await store.close()
            async with await connect_discovery(disco.url, security=security) as discovery:
                await discovery.advertise("k", b"v")
                assert await discovery.get_prefix("") == {"k": b"v"}

            side_client = SideChannelClient(guard=security)
            with pytest.raises(PeerLostError):
                await side_client.call(side.endpoint, GetMetadata(), 1.0, frames=[big])
            side_client.forget(side.endpoint)
            assert (await side_client.call(side.endpoint, GetMetadata(), 5.0)).ok
            await side_client.close()
        finally:
            await side.close()


async def test_a_wildcard_bind_advertises_the_given_host():
    async with RpcServer(echo, "tcp://0.0.0.0:0", advertise_host="127.0.0.1") as server:
        assert server.endpoint.startswith("tcp://127.0.0.1:")
        client = RpcClient()
        assert [c async for c in client.stream(server.endpoint, b"hi", RequestContext("r"))] == [b"hi"]
        await client.close()
    pub = ZmqBatchPublisher("tcp://0.0.0.0:0", "tcp://0.0.0.0:0", advertise_host="127.0.0.1")
    assert pub.endpoint.startswith("tcp://127.0.0.1:") and pub.replay_endpoint.startswith("tcp://127.0.0.1:")
    await pub.close()
    side = SideChannelServer("tcp://0.0.0.0:0", lambda *a: None, advertise_host="127.0.0.1")
    assert side.endpoint.startswith("tcp://127.0.0.1:")
    await side.close()
