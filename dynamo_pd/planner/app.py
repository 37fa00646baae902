"""The planner in a process: its planes, its /metrics, and the loop; for `python -m dynamo_pd.planner` (the
Kubernetes connector) and `python -m dynamo_pd.serve --planner` (the local connector, serve_local)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
from collections.abc import AsyncIterator, Callable

from prometheus_client import start_http_server

from dynamo_pd.planner.config import PlannerConfig
from dynamo_pd.planner.connectors import Connector, ConnectorError
from dynamo_pd.planner.connectors.local import Launch, LocalConnector
from dynamo_pd.planner.loop import Planner
from dynamo_pd.planner.metrics import PlannerMetrics
from dynamo_pd.planner.observe import Observer
from dynamo_pd.protocol import WorkerInfo
from dynamo_pd.runtime import Discovery, EventPlane, connect_event_plane
from dynamo_pd.runtime.security import Security
from dynamo_pd.worker import _connect_discovery

log = logging.getLogger("dynamo_pd.planner")


@contextlib.asynccontextmanager
async def planes(discovery_url: str, namespace: str, events_url: str | None, security: Security
                 ) -> AsyncIterator[tuple[Discovery, EventPlane]]:
    discovery = await _connect_discovery(discovery_url, namespace, security)  # waits for it, boundedly
    try:
        events = await connect_event_plane(events_url, discovery, security=security)
        try:
            yield discovery, events
        finally:
            await events.close()
    finally:
        await discovery.close()


async def plan(config: PlannerConfig, connector: Connector, discovery: Discovery, events: EventPlane,
               namespace: str, metrics_host: str, metrics_port: int) -> None:
    """Observe and decide until cancelled; /metrics on metrics_host:metrics_port (0: a free port)."""
    metrics = PlannerMetrics(config.pools)
    server, thread = start_http_server(metrics_port, metrics_host, metrics.registry)
    print(f"dynamo-pd metrics: planner at http://{metrics_host}:{server.server_port}/metrics", flush=True)
    observer = Observer(discovery, events, namespace)
    planner = Planner(config, observer, connector, metrics)
    try:
        await observer.start()
        await planner.run()
    finally:
        await planner.wait_scaling()
        await observer.close()
        server.shutdown()
        server.server_close()
        thread.join()


async def serve_local(config: PlannerConfig, launch: Launch, initial: dict[str, int], discovery_url: str,
                      namespace: str, events_url: str | None, security: Security, frontend: subprocess.Popen,
                      processes: list[subprocess.Popen], ready: Callable[[list[WorkerInfo]], None],
                      metrics_host: str) -> None:
    """serve --planner: the initial workers through the local connector, then the planner, until the
    frontend exits (SystemExit) or this is cancelled; every process started lands in `processes`."""
    async with planes(discovery_url, namespace, events_url, security) as (discovery, events):
        connector = LocalConnector(launch, discovery, config.pools, processes)
        started = await asyncio.gather(*(connector.set_replicas(pool, n) for pool, n in initial.items()),
                                       return_exceptions=True)
        if failed := [str(e) for e in started if isinstance(e, ConnectorError)]:
            raise SystemExit(f"error: a worker failed to start: {'; '.join(failed)}")
        ready(await discovery.list(WorkerInfo))
        planner = asyncio.create_task(plan(config, connector, discovery, events, namespace, metrics_host, 0))
        try:
            while frontend.poll() is None and not planner.done():
                await asyncio.wait([planner], timeout=0.5)  # a child's exit is polled: nothing to wait on
            if planner.done():
                planner.result()  # its error, if it failed
            raise SystemExit(f"error: the frontend exited with code {frontend.returncode} "
                             f"(log: {launch.log_dir}/frontend.log); stopping")
        finally:
            planner.cancel()
            await asyncio.gather(planner, return_exceptions=True)
            await connector.close()
