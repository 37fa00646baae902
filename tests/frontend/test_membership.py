"""State repair: the frontend's worker set and its subscriptions come back whole after outages,
on real discovery (embedded and etcd), NATS and ZMQ event planes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

import msgspec
import pytest

from dynamo_pd.frontend.backend import RemoteBackend
from dynamo_pd.frontend.membership import Membership
from dynamo_pd.frontend.replicas import EventPlaneReplicaSync
from dynamo_pd.metrics import Metrics
from dynamo_pd.protocol import LoadMetrics, WorkerInfo
from dynamo_pd.runtime import RequestContext, RpcServer, connect_discovery, connect_event_plane
from dynamo_pd.runtime.discovery_server import DiscoveryServer
from dynamo_pd.runtime.ports import free_port
from dynamo_pd.runtime.tasks import cancel_and_wait
from router.load import LoadKey
from router.service import KvRouter, RouterConfig
from router.worker import Role
from tests.servers import binary, running_server
from tests.waits import until

FAST = dict(ttl_s=2.0, keepalive_s=0.5, request_timeout_s=1.0)


def worker(worker_id: str, port: int = 1, role: Role = Role.DECODE) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, engine="native", model="model",
                      rpc_endpoint=f"tcp://127.0.0.1:{port}", block_size=16, num_kv_blocks=64)


class TcpProxy:
    """A byte pipe 127.0.0.1:port -> target that can be cut (every connection closed) and restored:
    the watcher's link to discovery fails while discovery itself and the workers stay up."""

    def __init__(self, target_port: int) -> None:
        self.port, self._target = free_port(), target_port
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        async with asyncio.timeout(5):
            while True:
                try:
                    self._server = await asyncio.start_server(self._pipe, "127.0.0.1", self.port)
                    return
                except OSError:  # the port is released asynchronously after a cut
                    await asyncio.sleep(0.05)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}

        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(copy(reader, up_writer), copy(up_reader, writer))

    async def cut(self) -> None:
        self._server.close()
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()
        await self._server.wait_closed()


@contextlib.asynccontextmanager
async def discovery_behind_proxy(kind: str, request):
    """(url for workers, url through the proxy for the watcher, the proxy)."""
    if kind == "etcd":
        url = request.getfixturevalue("etcd_url")
        port = int(url.rsplit(":", 1)[1])
        proxy = TcpProxy(port)
        await proxy.start()
        yield url, f"etcd://127.0.0.1:{proxy.port}", proxy
        return
    async with DiscoveryServer() as server:
        proxy = TcpProxy(int(server.url.rsplit(":", 1)[1]))
        await proxy.start()
        yield server.url, f"tcp://127.0.0.1:{proxy.port}", proxy


@pytest.mark.parametrize("kind", ["embedded", pytest.param("etcd", marks=pytest.mark.etcd)])
async def test_worker_that_leaves_during_a_long_outage_is_removed_after_it(kind, request):
    ns = "m" + uuid.uuid4().hex[:8]
    joined, left = [], []

    async def on_joined(info: WorkerInfo) -> None:
        joined.append(info.worker_id)

    async with discovery_behind_proxy(kind, request) as (url, proxied, proxy), \
            await connect_discovery(url, namespace=ns, **FAST) as registrar, \
            await connect_discovery(proxied, namespace=ns, **FAST) as watcher:
        watcher.reconnect_timeout_s = 1.0  # a watch gives up after 1 s; the outage lasts longer
        membership = Membership(watcher, on_joined, lambda info: left.append(info.worker_id), retry_s=0.5)
        task = asyncio.create_task(membership.run())
        try:
            await registrar.register(worker("w1"))
            gone = await registrar.register(worker("w2"))
            await until(lambda: sorted(joined) == ["w1", "w2"])
            await proxy.cut()
            await until(lambda: membership.outages >= 1, what="the watch to end")  # a new watch starts from scratch
            await gone.close()  # w2 leaves while the watcher cannot see it
            await asyncio.sleep(0.5)
            await proxy.start()
            await until(lambda: left == ["w2"], "w2 removed", 30)
            assert set(membership.workers) == {"w1"} and sorted(joined) == ["w1", "w2"]  # w1 not joined twice
            await registrar.register(worker("w3"))  # and the new watch follows changes as before
            await until(lambda: "w3" in joined)
        finally:
            await cancel_and_wait([task])
            await proxy.cut()


async def test_worker_registered_again_with_new_endpoints_is_dialled_anew():
    """A worker killed and restarted within its lease under the same id: no removal ever shows, only
    its registration changes; the frontend must leave the old endpoint and use the new one."""

    def answering(name: bytes):
        async def handler(payload: bytes, context: RequestContext):
            yield name
        return handler

    async def ask(backend: RemoteBackend) -> bytes:
        chunks = backend.rpc.stream(backend.workers["d0"].rpc_endpoint, b"", RequestContext(uuid.uuid4().hex))
        return b"".join([chunk async for chunk in chunks])

    kv_router, metrics = KvRouter(RouterConfig()), Metrics()
    async with DiscoveryServer() as server, await connect_discovery(server.url, **FAST) as watcher, \
            await connect_discovery(server.url, **FAST) as old_process, \
            await connect_discovery(server.url, **FAST) as new_process, \
            RpcServer(answering(b"old")) as old_rpc, RpcServer(answering(b"new")) as new_rpc:
        backend = RemoteBackend("model", None, 8192, watcher, None, kv_router, metrics)
        watching = asyncio.create_task(backend._watch_workers())
        try:
            old_info = msgspec.structs.replace(worker("d0"), rpc_endpoint=old_rpc.endpoint)
            new_info = msgspec.structs.replace(worker("d0"), rpc_endpoint=new_rpc.endpoint)
            await old_process.register(old_info)
            await until(lambda: "d0" in backend.workers)
            assert await ask(backend) == b"old"
            await new_process.register(new_info)  # same key, new lease, new ports; the old lease still holds
            await until(lambda: backend.workers.get("d0") == new_info, what="the new endpoint")
            assert await ask(backend) == b"new"
            assert backend.rpc.num_connections == 1  # the old connection went with its registration
            assert kv_router.place("r", list(range(40))).decode.worker_id == "d0"
        finally:
            await cancel_and_wait([watching])
            await backend.rpc.close()


@contextlib.contextmanager
def restartable_nats(tmp_path):
    port = free_port()
    args = [binary("nats-server"), "-a", "127.0.0.1", "-p", str(port)]
    stack = contextlib.ExitStack()

    def start() -> None:
        stack.enter_context(running_server(args, port, tmp_path / f"nats-{time.monotonic()}.log"))

    def stop() -> None:
        stack.close()

    start()
    try:
        yield f"nats://127.0.0.1:{port}", start, stop
    finally:
        stack.close()


async def restart_discovery(server: DiscoveryServer, down_s: float) -> DiscoveryServer:
    await server.close()
    await asyncio.sleep(down_s)
    server = DiscoveryServer(server.url)
    async with asyncio.timeout(5):
        while True:
            try:
                await server.start()
                return server
            except OSError:
                await asyncio.sleep(0.05)


@pytest.mark.parametrize("outage", ["nats_restart", "zmq_discovery_restart"])
async def test_load_and_replica_subscriptions_resume_after_the_event_plane_comes_back(outage, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="dynamo_pd.frontend")
    ns = "s" + uuid.uuid4().hex[:8]
    kv_router, metrics = KvRouter(RouterConfig()), Metrics()
    server = DiscoveryServer()
    await server.start()
    discoveries, planes, backend = [], [], None
    with restartable_nats(tmp_path) as (nats_url, nats_start, nats_stop):
        async def plane():
            discoveries.append(await connect_discovery(server.url, namespace=ns, **FAST))
            discoveries[-1].reconnect_timeout_s = 1.0  # the ZMQ subscription ends 1 s into the outage
            planes.append(await connect_event_plane(nats_url if outage == "nats_restart" else None, discoveries[-1]))
            return discoveries[-1], planes[-1]

        try:
            discovery, events = await plane()
            backend = RemoteBackend("model", None, 8192, discovery, events, kv_router, metrics, namespace=ns)
            await backend.start()
            worker_discovery, worker_plane = await plane()
            await worker_discovery.register(worker("d0"))
            await until(lambda: "d0" in backend.workers)
            other = EventPlaneReplicaSync(KvRouter(RouterConfig()).load, (await plane())[1], ns)
            await other.start()

            async def delivered(marker: float) -> None:
                """Publish a load report (its decode_s the marker) and a replica update until both reach
                the backend's router."""
                report = msgspec.msgpack.encode(LoadMetrics(worker_id="d0", num_running=1, num_waiting=0,
                                                            num_free_blocks=60, num_total_blocks=64,
                                                            decode_s=marker))
                applied = backend.replicas.applied
                async with asyncio.timeout(30):
                    # "d0" in workers: after a restart of the embedded server it is gone until it registers again
                    while not ("d0" in backend.workers and kv_router.load.costs("d0").decode_s == marker
                               and backend.replicas.applied > applied):
                        await worker_plane.publish(f"{ns}.load", report)
                        other.publish("finish", LoadKey("probe", Role.DECODE))  # applied, and changes no load
                        await asyncio.sleep(0.1)

            await delivered(0.01)
            if outage == "nats_restart":
                nats_stop()
                await asyncio.sleep(2.0)
                nats_start()
            else:
                server = await restart_discovery(server, 4.0)  # past the watch's 1 s of retries
            await delivered(0.02)
            if outage == "zmq_discovery_restart":  # these subscriptions ended with the outage and were made again
                back = {r.getMessage() for r in caplog.records if r.getMessage().endswith("is back")}
                assert back >= {f"subscription to '{ns}.load' is back", f"subscription to '{ns}.router.load' is back"}
        finally:
            if backend is not None:
                await backend.close()
            for p in planes:
                await p.close()
            for d in discoveries:
                await d.close()
            await server.close()
