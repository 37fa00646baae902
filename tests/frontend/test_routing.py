"""The frontend's routing of one request: one placement from the router, its prompt hashed once,
whichever pools it goes to; workers the frontend cannot serve are refused loudly."""

from __future__ import annotations

import asyncio
import logging

import router.service
from dynamo_pd.frontend.backend import RemoteBackend
from dynamo_pd.metrics import Metrics
from dynamo_pd.protocol import WorkerInfo
from dynamo_pd.runtime import connect_discovery
from dynamo_pd.runtime.discovery_server import DiscoveryServer
from dynamo_pd.runtime.tasks import cancel_and_wait
from router.hashing import block_hashes
from router.service import KvRouter, RouterConfig
from router.worker import Role


def test_a_request_routed_to_decode_and_prefill_hashes_its_prompt_once(monkeypatch):
    calls = []

    def counted(*args, **kwargs):
        calls.append(args)
        return block_hashes(*args, **kwargs)

    monkeypatch.setattr(router.service, "block_hashes", counted)
    kv_router = KvRouter(RouterConfig(block_size=4))
    kv_router.add_worker("prefill-0", "prefill", capacity_blocks=100)
    kv_router.add_worker("decode-0", "decode", capacity_blocks=100)
    # both by overlap: the decode worker may prefill locally (--local-prefill-tokens)
    placement = kv_router.place("r1", list(range(64)), local_prefill_tokens=1)
    assert (placement.decode.worker_id, placement.prefill.worker_id) == ("decode-0", "prefill-0")
    assert len(calls) == 1


def worker(worker_id: str, role: Role, block_size: int) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, engine="native", model="model", rpc_endpoint="tcp://127.0.0.1:1",
                      block_size=block_size, num_kv_blocks=64)


async def test_the_block_size_comes_from_the_workers_and_another_one_is_refused_loudly(caplog):
    kv_router, metrics = KvRouter(RouterConfig()), Metrics()
    async with DiscoveryServer() as server, await connect_discovery(server.url) as discovery:
        backend = RemoteBackend("model", None, 8192, discovery, None, kv_router, metrics)
        watching = asyncio.create_task(backend._watch_workers())
        with caplog.at_level(logging.ERROR, logger="dynamo_pd.frontend"):
            for info in (worker("d0", Role.DECODE, 32), worker("p0", Role.PREFILL, 16), worker("p1", Role.PREFILL, 32)):
                await discovery.register(info)
                async with asyncio.timeout(10):
                    while info.worker_id not in {*backend.workers, *backend._refused}:
                        await asyncio.sleep(0.02)
        await cancel_and_wait([watching])
    assert kv_router.block_size == 32 and set(backend.workers) == {"d0", "p1"}
    refusals = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(refusals) == 1 and all(s in refusals[0] for s in ("p0", "block size is 16", "the pool's is 32"))
    assert metrics.workers_refused.labels("block_size")._value.get() == 1
    assert kv_router.place("r", list(range(40))).prefill.worker_id == "p1"
