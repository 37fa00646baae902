"""The local connector with mocker workers: one `python -m dynamo_pd.mocker --control` process per pool (as
`serve --planner` starts it) that adds and drains single workers on command; a process that cannot start."""

import asyncio
import subprocess

import pytest
from prometheus_client import generate_latest

from dynamo_pd import serve
from dynamo_pd.planner.connectors import ConnectorError
from dynamo_pd.planner.connectors.local import Launch, LocalConnector
from dynamo_pd.planner.metrics import PlannerMetrics
from dynamo_pd.protocol import WorkerInfo
from dynamo_pd.runtime import DiscoveryServer, connect_discovery
from dynamo_pd.runtime.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
async def discovery():
    port = free_port()
    server = DiscoveryServer(f"tcp://127.0.0.1:{port}")
    await server.start()
    client = await connect_discovery(server.url, ttl_s=10.0)
    yield port, client
    await client.close()
    await server.close()


def launch_for(port: int, tmp_path, *extra: str) -> Launch:
    argv = ["--engine", "mocker", "--aggregated", "1", "--planner", "--ttft-slo", "500", "--itl-slo", "50",
            "--discovery-port", str(port), *extra]
    args, engine_argv = serve.parse_args(argv)
    return Launch(command=lambda role, worker_id: serve.worker_command(args, engine_argv, role, worker_id),
                  pool_command=lambda role: serve.pool_command(args, engine_argv, role, 0, control=True),
                  env=None, log_dir=tmp_path, drain_timeout_s=5.0, ready_timeout_s=240.0)


async def registered(client) -> list[str]:
    return sorted(info.worker_id for info in await client.list(WorkerInfo))


async def test_adds_and_drains_single_mocker_workers(discovery, tmp_path):
    port, client = discovery
    processes: list[subprocess.Popen] = []
    connector = LocalConnector(launch_for(port, tmp_path), client, ("aggregated",), processes)
    try:
        await connector.set_replicas("aggregated", 2)  # returns once both registered
        assert await registered(client) == ["aggregated-0", "aggregated-1"]
        assert await connector.replicas() == {"aggregated": 2}
        assert len(processes) == 1  # one process holds both
        await connector.set_replicas("aggregated", 3)
        assert await registered(client) == ["aggregated-0", "aggregated-1", "aggregated-2"]

        await connector.set_replicas("aggregated", 1)  # the newest two drain
        assert await connector.replicas() == {"aggregated": 1}  # draining workers no longer count
        await connector.wait_drained()
        assert await registered(client) == ["aggregated-0"]
        assert processes[0].poll() is None  # the process serves on with the one left
        seconds = connector.worker_seconds()["aggregated"]
        # the planner's counter reads the connector at each scrape, not once an interval (no planner here)
        metrics = PlannerMetrics(("aggregated",))
        metrics.count_worker_seconds(connector.worker_seconds)
        scraped = lambda: next(float(line.rpartition(" ")[2])  # noqa: E731
                               for line in generate_latest(metrics.registry).decode().splitlines()
                               if line.startswith('dynamo_pd_planner_worker_seconds_total{pool="aggregated"}'))
        before = scraped()
        assert before >= seconds
        await connector.set_replicas("aggregated", 2)  # ids are never reused
        assert await registered(client) == ["aggregated-0", "aggregated-3"]
        assert connector.worker_seconds()["aggregated"] > seconds
        assert scraped() > before
    finally:
        await connector.close()
    await asyncio.to_thread(processes[0].wait, 30)  # the end of its commands stops it
    assert processes[0].returncode == 0


async def test_a_pool_process_that_cannot_start_leaves_the_pool_as_it_was(discovery, tmp_path):
    port, client = discovery
    processes: list[subprocess.Popen] = []
    launch = launch_for(port, tmp_path, "--speedup", "-1")  # the mocker refuses it as it starts a worker
    connector = LocalConnector(launch, client, ("aggregated",), processes)
    try:
        with pytest.raises(ConnectorError, match=r"add aggregated-0: .*--speedup must be positive, got -1"):
            await connector.set_replicas("aggregated", 1)
        assert await connector.replicas() == {"aggregated": 0}
        assert await registered(client) == []
    finally:
        await connector.close()
