"""A mocker worker's engine and hand-off manager in a process of their own, holding one prompt's prefix for
peers to pull (tests/kv_transfer/test_peer_pull.py kills it in the middle of a pull)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

from dynamo_pd.engines.base import EngineConfig
from dynamo_pd.engines.mocker.engine import MockerEngine
from dynamo_pd.handoff import HandoffManager, HandoffTimes
from dynamo_pd.protocol import EngineRequest
from dynamo_pd.runtime import RequestContext


def _serve(conn, config: EngineConfig, times: HandoffTimes, request: EngineRequest) -> None:
    asyncio.run(_serve_async(conn, config, times, request))


async def _serve_async(conn, config: EngineConfig, times: HandoffTimes, request: EngineRequest) -> None:
    engine = MockerEngine(config)
    manager = HandoffManager("holder", times, "zmq")
    await engine.start()
    await manager.start(engine, "m")
    async for _ in engine.generate(request, RequestContext(request.request_id)):
        pass  # its prefix is cached now
    conn.send(manager.agent.endpoint)
    await asyncio.to_thread(conn.recv)  # until told to go (or killed)


class PrefixHolder:
    def __init__(self, config: EngineConfig, times: HandoffTimes, request: EngineRequest):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, config, times, request), daemon=True)
        self.process.start()
        if not self.conn.poll(120):
            raise TimeoutError("the holder process did not start within 120 s")
        self.endpoint = self.conn.recv()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)
