"""The gateway on real embedded discovery and a real event plane: a backend per model its workers
register, each seeing only its model's workers; a worker taken out of routing and readmitted."""

from __future__ import annotations

import pytest

from dynamo_pd.frontend.backend import RemoteBackend
from dynamo_pd.frontend.gateway import Gateway, ModelNotFoundError
from dynamo_pd.metrics import Metrics
from dynamo_pd.protocol import WorkerInfo
from dynamo_pd.runtime import DiscoveryServer, connect_discovery, connect_event_plane
from router.service import KvRouter, RouterConfig
from router.worker import Role
from tests.waits import until


def worker(worker_id: str, model: str, role: Role = Role.AGGREGATED) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, engine="native", model=model, model_path=f"/models/{model}",
                      rpc_endpoint="tcp://127.0.0.1:1", block_size=4, num_kv_blocks=64)


@pytest.fixture
async def gateway():
    made = []
    async with DiscoveryServer() as server, await connect_discovery(server.url) as discovery:
        events = await connect_event_plane(None, discovery)

        async def make(name, model_path, view):
            made.append((name, model_path))
            backend = RemoteBackend(name, None, 8192, view, events, KvRouter(RouterConfig()), Metrics())
            await backend.start()
            return backend

        gateway = Gateway(discovery, make)
        await gateway.start()
        gateway.made, gateway.registry = made, discovery
        yield gateway
        await gateway.close()
        await events.close()


async def test_each_model_gets_its_own_backend_with_only_its_workers(gateway):
    regs = {w.worker_id: await gateway.registry.register(w)
            for w in (worker("a0", "A"), worker("a1", "A", Role.PREFILL), worker("b0", "B"))}
    await until(lambda: gateway.served() == ["A", "B"])
    assert sorted(gateway.made) == [("A", "/models/A"), ("B", "/models/B")]  # once per model
    a, b = gateway.lookup("A"), gateway.lookup("B")
    await until(lambda: set(a.workers) == {"a0", "a1"} and set(b.workers) == {"b0"})
    assert a.router.workers(Role.AGGREGATED) == ["a0"] and b.router.workers(Role.AGGREGATED) == ["b0"]
    with pytest.raises(ModelNotFoundError, match="'C' does not exist; this server serves 'A', 'B'"):
        gateway.lookup("C")

    await regs["b0"].close()  # B's last worker leaves: B is no longer served, A still is
    await until(lambda: gateway.served() == ["A"])
    assert not b.workers

    view = gateway.models["A"].view
    view.exclude("a0")  # out of routing (a failed health check), still registered
    await until(lambda: "a0" not in a.workers)
    assert a.router.workers(Role.AGGREGATED) == [] and gateway.served() == []
    view.readmit("a0")
    await until(lambda: "a0" in a.workers)
    assert a.router.workers(Role.AGGREGATED) == ["a0"] and gateway.served() == ["A"]


async def test_a_model_whose_backend_cannot_be_made_is_logged_and_the_others_served(caplog):
    async with DiscoveryServer() as server, await connect_discovery(server.url) as discovery:
        events = await connect_event_plane(None, discovery)

        async def make(name, model_path, view):
            if name == "bad":
                raise FileNotFoundError(f"no tokenizer at {model_path}")
            backend = RemoteBackend(name, None, 8192, view, events, KvRouter(RouterConfig()), Metrics())
            await backend.start()
            return backend

        gateway = Gateway(discovery, make)
        await gateway.start()
        for w in (worker("x0", "bad"), worker("g0", "good")):
            await discovery.register(w)
        await until(lambda: gateway.served() == ["good"])
        await until(lambda: gateway.models["bad"].failed)
        assert any("cannot serve model 'bad'" in r.getMessage() and "/models/bad" in r.getMessage()
                   for r in caplog.records)
        with pytest.raises(ModelNotFoundError):
            gateway.lookup("bad")
        await gateway.close()
        await events.close()
