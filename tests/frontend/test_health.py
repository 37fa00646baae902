"""The health checker against real RPC servers: a worker whose canary errors, or times out while it streams
nothing else, leaves routing; one whose canary times out while it streams other requests' outputs is busy,
not hung, and stays; a passing canary brings an excluded worker back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace

import msgspec

from dynamo_pd.frontend.gateway import ModelEntry, ModelView
from dynamo_pd.frontend.health import HealthChecker
from dynamo_pd.protocol import EngineOutput, WorkerInfo
from dynamo_pd.runtime import RequestContext, RpcServer
from router.worker import Role

TIMEOUT_S = 0.5


async def hung(payload: bytes, context: RequestContext) -> AsyncIterator[bytes]:
    await asyncio.sleep(3600)  # the canary's cancellation ends it
    yield b""


async def failing(payload: bytes, context: RequestContext) -> AsyncIterator[bytes]:
    yield msgspec.msgpack.encode(EngineOutput(request_id="c", token_ids=[], finish_reason="error"))


async def answering(payload: bytes, context: RequestContext) -> AsyncIterator[bytes]:
    yield msgspec.msgpack.encode(EngineOutput(request_id="c", token_ids=[7], finish_reason="length"))


async def checked(handler, streams_meanwhile: bool, excluded_before: bool = False) -> bool:
    """Whether the worker behind `handler` is out of routing after one round of health checks."""
    async with RpcServer(handler) as server:
        view = ModelView(discovery=None)
        view.update("added", WorkerInfo(worker_id="w", role=Role.AGGREGATED, engine="native", model="m",
                                        rpc_endpoint=server.endpoint))
        if excluded_before:
            view.exclude("w")
        entry = ModelEntry("m", view)
        # the RemoteBackend's parts the checker reads: the tokenizer and when each worker last streamed
        entry.backend = SimpleNamespace(tokenizer=None, last_output={})
        checker = HealthChecker(SimpleNamespace(models={"m": entry}, metrics=None))

        async def stream_other_requests() -> None:
            while True:
                await asyncio.sleep(0.05)
                entry.backend.last_output["w"] = time.monotonic()

        other = asyncio.create_task(stream_other_requests()) if streams_meanwhile else None
        try:
            await checker.check_all(TIMEOUT_S)
        finally:
            if other is not None:
                other.cancel()
            await checker.close()
        return "w" in view.excluded


async def test_a_hung_worker_leaves_routing():
    assert await checked(hung, streams_meanwhile=False)


async def test_a_busy_worker_whose_canary_waits_behind_other_requests_stays():
    assert not await checked(hung, streams_meanwhile=True)


async def test_a_canary_that_errors_takes_the_worker_out_even_while_it_streams_others():
    assert await checked(failing, streams_meanwhile=True)


async def test_a_passing_canary_readmits_an_excluded_worker():
    assert not await checked(answering, streams_meanwhile=False, excluded_before=True)
    assert await checked(hung, streams_meanwhile=False, excluded_before=True)  # until it passes, it stays out
