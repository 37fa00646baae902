"""Subprocess roles for the runtime tests (killed with SIGKILL to test failure handling).

    proc.py register DISCOVERY_URL WORKER_ID   registers a worker, prints READY, waits
    proc.py rpc_server                         serves a stream of b"tick" forever, prints READY ENDPOINT
    proc.py echo_server                        streams each payload back three times, prints READY ENDPOINT
    proc.py rpc_client ENDPOINT                streams 100k bytes, prints READY after the first chunk
"""

from __future__ import annotations

import asyncio
import sys

import uvloop

from dynamo_pd.protocol import WorkerInfo
from dynamo_pd.runtime import RequestContext
from dynamo_pd.runtime.discovery import connect_discovery
from dynamo_pd.runtime.rpc_client import RpcClient
from dynamo_pd.runtime.rpc_server import RpcServer


async def register(url: str, worker_id: str) -> None:
    discovery = await connect_discovery(url)
    await discovery.register(WorkerInfo(worker_id=worker_id, role="decode", engine="native", model="m",
                                        rpc_endpoint="tcp://127.0.0.1:1"))
    print("READY", flush=True)
    await asyncio.sleep(3600)


async def ticks(payload: bytes, context: RequestContext):
    while True:
        yield b"tick"
        await asyncio.sleep(0.05)


async def rpc_server() -> None:
    async with RpcServer(ticks) as server:
        print("READY", server.endpoint, flush=True)
        await asyncio.sleep(3600)


async def echo_thrice(payload: bytes, context: RequestContext):
    for _ in range(3):
        yield payload
        await asyncio.sleep(0)


async def echo_server() -> None:
    async with RpcServer(echo_thrice) as server:
        print("READY", server.endpoint, flush=True)
        await asyncio.sleep(3600)


async def rpc_client(endpoint: str) -> None:
    client = RpcClient()
    async for _ in client.stream(endpoint, b"x" * 100_000, RequestContext("from-subprocess")):
        print("READY", flush=True)
        await asyncio.sleep(3600)  # holds the stream open until killed


ROLES = {"register": register, "rpc_server": rpc_server, "echo_server": echo_server, "rpc_client": rpc_client}

if __name__ == "__main__":
    uvloop.run(ROLES[sys.argv[1]](*sys.argv[2:]))
