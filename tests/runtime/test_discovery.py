"""Discovery: register / list / watch / lease expiry, for the embedded server and for real etcd."""

from __future__ import annotations

import asyncio
import signal
import uuid

import pytest

from dynamo_pd.protocol import WorkerInfo
from dynamo_pd.runtime.discovery import connect_discovery
from dynamo_pd.runtime.discovery_server import DiscoveryServer
from dynamo_pd.runtime.errors import DiscoveryUnavailableError

from tests.servers import free_port


def worker(worker_id: str, role: str = "prefill") -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, engine="native", model="m",
                      rpc_endpoint="tcp://127.0.0.1:5555", num_kv_blocks=128)


@pytest.fixture(params=["embedded", pytest.param("etcd", marks=pytest.mark.etcd)])
async def discovery_url(request):
    if request.param == "etcd":
        yield request.getfixturevalue("etcd_url")
        return
    async with DiscoveryServer() as server:
        yield server.url


async def next_change(watch, timeout_s: float = 10.0):
    return await asyncio.wait_for(anext(watch), timeout_s)


async def test_register_list_watch_and_revoke(discovery_url):
    ns = "t" + uuid.uuid4().hex[:8]  # one etcd serves every test: keep them apart
    async with await connect_discovery(discovery_url, namespace=ns) as watcher, \
            await connect_discovery(discovery_url, namespace=ns) as registrar:
        first = await registrar.register(worker("w1"))
        watch = watcher.watch(WorkerInfo)
        assert await next_change(watch) == ("added", worker("w1"))

        second = await registrar.register(worker("w2", "decode"))
        assert await next_change(watch) == ("added", worker("w2", "decode"))
        assert [w.worker_id for w in await watcher.list(WorkerInfo)] == ["w1", "w2"]

        await first.close()
        assert await next_change(watch) == ("removed", worker("w1"))
        assert [w.worker_id for w in await watcher.list(WorkerInfo)] == ["w2"]
        await second.close()
        assert await next_change(watch) == ("removed", worker("w2", "decode"))
        await watch.aclose()


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP])
async def test_killed_worker_leaves_within_ttl(discovery_url, procs, how):
    """SIGKILL: a dead process (its connection closes); SIGSTOP: a frozen host, whose connection stays
    open and silent, so only its lease running out can remove it."""
    ns = "dynamo_pd"  # proc.py uses the default namespace; give etcd a fresh worker id instead
    worker_id = "killed-" + uuid.uuid4().hex[:8]
    async with await connect_discovery(discovery_url, namespace=ns) as discovery:
        watch = discovery.watch_prefix("workers/" + worker_id)
        proc = procs.start("register", discovery_url, worker_id)
        await procs.ready(proc)
        kind, key, _ = await next_change(watch)
        assert (kind, key) == ("added", "workers/" + worker_id)

        proc.send_signal(how)  # no revoke, no keep-alive
        kind, key, _ = await next_change(watch, timeout_s=discovery.ttl_s + 5)
        assert (kind, key) == ("removed", "workers/" + worker_id)
        assert worker_id not in [w.worker_id for w in await discovery.list(WorkerInfo)]
        await watch.aclose()


async def test_keepalive_holds_registration_past_ttl(discovery_url):
    ns = "t" + uuid.uuid4().hex[:8]
    async with await connect_discovery(discovery_url, namespace=ns, ttl_s=2.0, keepalive_s=0.5) as discovery:
        await discovery.register(worker("w1"))
        await asyncio.sleep(3.5)
        assert [w.worker_id for w in await discovery.list(WorkerInfo)] == ["w1"]


async def test_lost_lease_is_granted_again(discovery_url):
    ns = "t" + uuid.uuid4().hex[:8]
    async with await connect_discovery(discovery_url, namespace=ns, keepalive_s=0.3) as discovery:
        reg = await discovery.register(worker("w1"))
        watch = discovery.watch(WorkerInfo)
        assert await next_change(watch) == ("added", worker("w1"))
        await discovery._store.revoke(reg._lease_id)  # as if the lease had run out during a stall
        assert await next_change(watch) == ("removed", worker("w1"))
        assert await next_change(watch) == ("added", worker("w1"))
        await watch.aclose()


async def test_watch_resyncs_after_embedded_server_restart():
    server = DiscoveryServer()
    url = await server.start()
    fast = dict(ttl_s=2.0, keepalive_s=0.5, request_timeout_s=1.0)
    async with await connect_discovery(url, **fast) as registrar, \
            await connect_discovery(url, **fast) as watcher:
        await registrar.register(worker("w1"))
        watch = watcher.watch(WorkerInfo)
        assert await next_change(watch) == ("added", worker("w1"))
        await server.close()
        # Same address, empty state: the registration re-registers, the watch resyncs.
        server = DiscoveryServer(url)
        async with asyncio.timeout(5):
            while True:  # the old socket releases the port asynchronously
                try:
                    await server.start()
                    break
                except OSError:
                    await asyncio.sleep(0.05)
        try:
            await registrar.register(worker("w2"))
            # w1's keep-alive finds its lease gone and puts it again; the watch resyncs and sees w2.
            seen = set()
            while "w2" not in seen:
                kind, info = await next_change(watch, 15)
                if kind == "added":
                    seen.add(info.worker_id)
            async def w1_back():
                while {w.worker_id for w in await watcher.list(WorkerInfo)} != {"w1", "w2"}:
                    await asyncio.sleep(0.2)
            await asyncio.wait_for(w1_back(), 10)
        finally:
            await watch.aclose()
            await server.close()


async def test_unreachable_backends_raise_in_bounded_time():
    port = free_port()
    discovery = await connect_discovery(f"tcp://127.0.0.1:{port}", request_timeout_s=0.5)
    with pytest.raises(DiscoveryUnavailableError, match="did not answer Grant"):
        await discovery.register(worker("w1"))
    await discovery.close()
    with pytest.raises(DiscoveryUnavailableError, match="etcd"):
        await connect_discovery(f"etcd://127.0.0.1:{port}", request_timeout_s=1.0)



async def test_registering_outlasts_a_backend_slow_to_answer():
    """A loaded host's discovery server may miss a Grant's deadline: the worker retries, it does not die."""
    port = free_port()
    discovery = await connect_discovery(f"tcp://127.0.0.1:{port}", request_timeout_s=0.5)
    registering = asyncio.create_task(discovery.register(worker("w1")))
    await asyncio.sleep(1.5)  # three request timeouts pass with nobody listening
    assert not registering.done()
    async with DiscoveryServer(f"tcp://127.0.0.1:{port}") as server:
        registration = await asyncio.wait_for(registering, 10)
        async with await connect_discovery(server.url) as observer:
            assert [w.worker_id for w in await observer.list(WorkerInfo)] == ["w1"]
        await registration.close()
    await discovery.close()

async def test_bad_url_and_bad_worker_id_are_rejected():
    with pytest.raises(ValueError, match="must start with etcd:// or tcp://"):
        await connect_discovery("http://127.0.0.1:1")
    async with DiscoveryServer() as server:
        async with await connect_discovery(server.url) as discovery:
            with pytest.raises(ValueError, match="worker_id"):
                await discovery.register(worker("a/b"))
