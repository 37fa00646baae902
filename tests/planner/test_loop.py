"""The planner's loop on real planes (embedded discovery, the ZMQ event plane): workers' registrations and
load reports and a router's placements, as those processes put them there, observed and decided on, the
decisions carried out through the Kubernetes connector against the API's own shapes (k8s_api.py)."""

import asyncio
import logging
import time

import msgspec
import pytest
from kubernetes.aio import client
from prometheus_client import generate_latest

from dynamo_pd.frontend.replicas import EventPlaneReplicaSync
from dynamo_pd.planner.config import DISAGGREGATED, PlannerConfig
from dynamo_pd.planner.connectors.kubernetes import KubernetesConnector
from dynamo_pd.planner.loop import Planner
from dynamo_pd.planner.metrics import PlannerMetrics
from dynamo_pd.planner.observe import Observer
from dynamo_pd.protocol import LoadMetrics, WorkerInfo
from dynamo_pd.runtime import DiscoveryServer, connect_discovery, connect_event_plane
from router.load import LoadKey, LoadTracker
from router.replica_sync import LoadUpdate, ReplicaSync, encode
from router.worker import Role
from tests.planner.k8s_api import FakeApiServer
from tests.waits import until

NS = "plannertest"
PER_TOKEN = 25e-6  # s: the mocker's 8B model on an H100 prefills 3000 tokens in 75 ms


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
async def stage():
    """Discovery, and a `connect()` giving each stand-in process its own discovery client and event plane."""
    server = DiscoveryServer()
    await server.start()
    opened = []

    async def connect():
        # a long lease: this host is loaded, and one lost drops the messages sent while it registers again
        discovery = await connect_discovery(server.url, namespace=NS, ttl_s=15.0)
        events = await connect_event_plane(None, discovery)
        opened.append((discovery, events))
        return discovery, events

    yield connect
    for discovery, events in reversed(opened):
        await events.close()
        await discovery.close()
    await server.close()


@pytest.fixture
async def api():
    server = FakeApiServer("serving", {"llm-prefill": 1, "llm-decode": 1})
    await server.start()
    yield server
    await server.close()


class Deployment:
    """What the workers (registrations, load reports) and a frontend's router (placements) publish."""

    def __init__(self, discovery, events) -> None:
        self.discovery, self.events = discovery, events
        self.sync = ReplicaSync(LoadTracker(), "frontend-test", send=self._send)
        self.sent: list[asyncio.Task] = []

    def _send(self, update: LoadUpdate) -> None:
        self.sent.append(asyncio.create_task(self.events.publish(f"{NS}.router.load", encode([update]))))

    async def register(self, worker_id: str, role: Role) -> None:
        await self.discovery.register(WorkerInfo(worker_id=worker_id, role=role, engine="mocker", model="m",
                                                 rpc_endpoint="tcp://127.0.0.1:1", block_size=16,
                                                 num_kv_blocks=20_000, max_num_seqs=64))

    async def report(self) -> None:
        idle = dict(num_running=0, num_waiting=0, num_free_blocks=20_000, num_total_blocks=20_000)
        for report in (LoadMetrics(worker_id="prefill-0", prefill_s_per_token=PER_TOKEN, output_tokens=1.0,
                                   **idle),
                       LoadMetrics(worker_id="decode-0", decode_s=6.6e-3, decode_s_per_block=0.8e-6,
                                   output_tokens=150.0, **idle)):
            await self.events.publish(f"{NS}.load.{report.worker_id}", msgspec.msgpack.encode(report))

    async def place(self, count: int, start: int = 0) -> None:
        for i in range(start, start + count):
            self.sync.publish("place", LoadKey(f"r{i}", Role.PREFILL), "prefill-0", 3000, 188)
            self.sync.publish("place", LoadKey(f"r{i}", Role.DECODE), "decode-0", 0, 188)
        await asyncio.gather(*self.sent)

    async def finish(self, count: int, ttft_s: float, itl_s: float, start: int = 0) -> None:
        """The frontend's ends of requests that streamed to their end, with what their clients saw."""
        for i in range(start, start + count):
            for role in (Role.PREFILL, Role.DECODE):
                self.sync.publish("finish", LoadKey(f"r{i}", role), ttft_s=ttft_s, itl_s=itl_s)
        await asyncio.gather(*self.sent)


@pytest.fixture
async def running(stage, api):
    """A planner's observer following a deployment of one prefill and one decode worker, and a connector."""
    deployment = Deployment(*await stage())
    clock = Clock()
    observer = Observer(*await stage(), namespace=NS, clock=clock)
    await observer.start()
    for worker_id, role in (("prefill-0", Role.PREFILL), ("decode-0", Role.DECODE)):
        await deployment.register(worker_id, role)
    await until(lambda: len(observer.membership.workers) == 2, "both registrations")
    deadline = time.monotonic() + 20
    while len(observer._reports) < 2:  # ZMQ's subscriptions connect shortly after subscribing: report again
        assert time.monotonic() < deadline, "the workers' load reports not seen within 20 s"
        await deployment.report()
        await asyncio.sleep(0.05)
    probe = 0
    while not observer._arrivals:  # the router's placements, likewise
        assert time.monotonic() < deadline, "the router's placements not seen within 20 s"
        await deployment.place(1, start=probe)
        probe += 1
        await asyncio.sleep(0.05)
    observer.collect(DISAGGREGATED)  # the probes are not the test's load
    connector = KubernetesConnector(client.ApiClient(client.Configuration(host=api.url)), "serving", "llm",
                                    DISAGGREGATED)
    yield deployment, observer, connector, clock
    await connector.close()
    await observer.close()


def planner_for(observer, connector, clock, **config) -> Planner:
    config = PlannerConfig(DISAGGREGATED, **{"ttft_slo_s": 0.3, "itl_slo_s": 0.02, "cooldown_s": 0.0,
                                             **config})
    return Planner(config, observer, connector, PlannerMetrics(DISAGGREGATED), clock=clock)


def rendered(planner: Planner, name: str, pool: str) -> float:
    text = generate_latest(planner.metrics.registry).decode()
    line = next((line for line in text.splitlines() if line.startswith(f'{name}{{pool="{pool}"}} ')), None)
    assert line is not None, f"{name} for {pool} is not rendered"
    return float(line.split()[-1])


async def interval(deployment, observer, clock, requests: int, seconds: float = 10.0) -> None:
    """`requests` placements on each pool over the next `seconds`, seen by the observer."""
    await deployment.place(requests, start=1000)
    seen = lambda: len(observer._arrivals.get("prefill", []))  # noqa: E731
    await until(lambda: seen() >= requests, f"{requests} placements")
    clock.t += seconds


async def test_load_grows_the_pools_it_needs(running, api, caplog):
    deployment, observer, connector, clock = running
    planner = planner_for(observer, connector, clock)
    await interval(deployment, observer, clock, requests=240)  # 24 req/s of 3000-token prompts
    with caplog.at_level(logging.INFO, logger="dynamo_pd.planner"):
        decisions = {d.pool: d for d in await planner.step()}
        await planner.wait_scaling()
    prefill = decisions["prefill"]
    assert prefill.target >= 2  # 1.8 s of prefill a second
    assert prefill.prediction.ttft_attainment >= 0.95 and prefill.prediction.utilization < 1
    assert api.replicas == {"llm-prefill": prefill.target, "llm-decode": decisions["decode"].target}
    assert f"planner prefill: up 1 -> {prefill.target}: the least count meeting the SLO" in caplog.text
    assert rendered(planner, "dynamo_pd_planner_replicas", "prefill") == prefill.target
    rate = rendered(planner, "dynamo_pd_planner_predicted_requests_per_second", "prefill")
    assert rate == pytest.approx(24.0)


async def test_latencies_measured_over_the_models_correct_its_predictions(running, api, caplog):
    """What the requests that ended measured beyond the model (here 150 ms of TTFT and 4 ms of ITL the model
    cannot see) is added to its predictions: the same load needs more workers once it is known."""
    deployment, observer, connector, clock = running
    planner = planner_for(observer, connector, clock, predictor="constant")
    await interval(deployment, observer, clock, requests=60)  # 6 req/s: one prefill worker suffices
    blind = {d.pool: d for d in await planner.step()}
    await planner.wait_scaling()
    modelled_ttft, modelled_itl = blind["prefill"].prediction.ttft_p50_s, blind["decode"].prediction.itl_s
    await deployment.finish(60, ttft_s=modelled_ttft + 0.15, itl_s=modelled_itl + 0.004, start=1000)
    await until(lambda: len(observer._latencies.get("decode", ((), ()))[1]) >= 60, "60 requests' ends")
    await interval(deployment, observer, clock, requests=60)
    with caplog.at_level(logging.INFO, logger="dynamo_pd.planner"):
        seen = {d.pool: d for d in await planner.step()}
        await planner.wait_scaling()
    ttft_offset, itl_offset = planner.offsets["prefill"].ttft_p50, planner.offsets["decode"].itl_mean
    assert ttft_offset == pytest.approx(0.15, abs=0.02) and itl_offset == pytest.approx(0.004, abs=1e-3)
    assert blind["prefill"].target == 1 and seen["prefill"].target > 1  # 300 ms less 150: queueing matters
    assert seen["decode"].prediction.itl_s == pytest.approx(blind["decode"].prediction.itl_s + 0.004, abs=2e-3)
    assert "offsets TTFT +15" in caplog.text and "measured ITL p50" in caplog.text
    assert rendered(planner, "dynamo_pd_planner_measured_ttft_seconds", "prefill") == pytest.approx(
        modelled_ttft + 0.15)


async def test_the_cool_down_follows_a_growth_not_a_shrink(running, api):
    """A falling load shrinks a pool interval after interval; only a growth starts the cool-down (a shrink
    right after one would be the flap it bounds)."""
    deployment, observer, connector, clock = running
    planner = planner_for(observer, connector, clock, cooldown_s=30.0, predictor="constant")
    targets = []
    for requests, seconds in ((240, 10.0), (480, 40.0), (10, 10.0)):  # 24, then 12 (over 40 s), then 1 req/s
        await interval(deployment, observer, clock, requests=requests, seconds=seconds)
        targets.append({d.pool: d.target for d in await planner.step()}["prefill"])
        await planner.wait_scaling()
    assert targets[0] > targets[1] > targets[2] == 1, targets  # the last, 10 s after a shrink: not held
    await interval(deployment, observer, clock, requests=240)  # grows again: 10 s later a fall is held
    grown = {d.pool: d for d in await planner.step()}["prefill"]
    await planner.wait_scaling()
    await interval(deployment, observer, clock, requests=10)
    held = {d.pool: d for d in await planner.step()}["prefill"]
    assert grown.target > 1 and held.target == grown.target and "cool-down" in held.reason


async def test_an_slo_the_budget_cannot_meet_holds_its_maximum(running, api, caplog):
    deployment, observer, connector, clock = running
    planner = planner_for(observer, connector, clock, budget=5)
    await interval(deployment, observer, clock, requests=600)  # 60 x 75 ms of prefill a second: 4.5 workers busy
    with caplog.at_level(logging.INFO, logger="dynamo_pd.planner"):
        decisions = {d.pool: d for d in await planner.step()}
        await planner.wait_scaling()
    # the budget, all of it: a worker at a time to the pool furthest short of its need
    assert (decisions["prefill"].target, decisions["decode"].target) == (3, 2)
    for pool in ("prefill", "decode"):
        assert decisions[pool].unmeetable
        assert rendered(planner, "dynamo_pd_planner_slo_unmeetable", pool) == 1
        assert rendered(planner, "dynamo_pd_planner_slo_unmeetable_intervals_total", pool) == 1
    warning = next(r for r in caplog.records if r.levelno == logging.WARNING)
    assert warning.getMessage().startswith(
        "planner prefill: up 1 -> 3: SLO unmeetable within the budget: it needs prefill 5 + decode 3 "
        "workers, over --budget 5; holding the budget's maximum")
    assert api.replicas == {"llm-prefill": 3, "llm-decode": 2}


async def test_a_connector_error_leaves_the_pool_and_is_retried(running, api, caplog):
    deployment, observer, connector, clock = running
    planner = planner_for(observer, connector, clock, cooldown_s=300.0)
    api.failures.append(("PATCH", 500, "InternalError", "etcdserver: request timed out"))
    await interval(deployment, observer, clock, requests=240)
    with caplog.at_level(logging.INFO, logger="dynamo_pd.planner"):
        first = {d.pool: d for d in await planner.step()}
        await planner.wait_scaling()
    assert first["prefill"].change > 0
    assert api.replicas == {"llm-prefill": 1, "llm-decode": 1}  # as it was
    assert rendered(planner, "dynamo_pd_planner_connector_errors_total", "prefill") == 1
    failed = f"planner prefill: scaling 1 -> {first['prefill'].target} failed, the pool is as it was"
    assert failed in caplog.text
    await interval(deployment, observer, clock, requests=240)
    second = {d.pool: d for d in await planner.step()}  # no cool-down: nothing had changed
    await planner.wait_scaling()
    assert second["prefill"].reason.startswith(f"up 1 -> {second['prefill'].target}")
    assert api.replicas["llm-prefill"] == second["prefill"].target > 1


async def test_an_unreadable_deployment_is_tried_again(running, api, caplog):
    deployment, observer, connector, clock = running
    planner = planner_for(observer, connector, clock)
    api.failures.append(("GET", 503, "ServiceUnavailable", "the server is unable to handle the request"))
    await interval(deployment, observer, clock, requests=10)
    with caplog.at_level(logging.ERROR, logger="dynamo_pd.planner"):
        assert await planner.step() == []
    unread = ("planner: cannot read the pools' sizes (reading the scale of llm-prefill in namespace serving: "
              "HTTP 503")
    assert unread in caplog.text
    assert rendered(planner, "dynamo_pd_planner_connector_errors_total", "decode") == 1
    await interval(deployment, observer, clock, requests=10)
    assert [d.pool for d in await planner.step()] == ["prefill", "decode"]


async def test_waits_for_step_costs(stage, api):
    """Before a worker measured its costs, the planner holds and says what it waits for."""
    deployment = Deployment(*await stage())
    clock = Clock()
    observer = Observer(*await stage(), namespace=NS, clock=clock)
    await observer.start()
    await deployment.register("prefill-0", Role.PREFILL)
    await deployment.register("decode-0", Role.DECODE)
    await until(lambda: len(observer.membership.workers) == 2, "both registrations")
    connector = KubernetesConnector(client.ApiClient(client.Configuration(host=api.url)), "serving", "llm",
                                    DISAGGREGATED)
    try:
        planner = planner_for(observer, connector, clock)
        clock.t += 10
        decisions = await planner.step()
        assert [d.reason for d in decisions] == [
            "hold 1 -> 1: waiting for prefill step costs (a prompt served)",
            "hold 1 -> 1: waiting for decode step costs (a request served)"]
        assert [r.method for r in api.requests] == ["GET", "GET"]  # read, nothing patched
    finally:
        await connector.close()
        await observer.close()


async def test_a_frontend_publishes_its_placements_to_the_planner_alone(stage):
    """A frontend publishes placements only while another reader says hello (frontend.replicas): with no
    other frontend, the planner's hello is what makes its router's placements reach it."""
    sync = EventPlaneReplicaSync(LoadTracker(), (await stage())[1], NS)
    observer = Observer(*await stage(), namespace=NS)
    await sync.start()
    await observer.start()
    try:
        await until(lambda: sync.has_peers, "the planner's hello")
        deadline, probe = time.monotonic() + 20, 0
        while not observer._arrivals:  # ZMQ's subscriptions connect shortly after subscribing: place again
            assert time.monotonic() < deadline, "the router's placements not seen within 20 s"
            sync.publish("place", LoadKey(f"r{probe}", Role.PREFILL), "prefill-0", 3000, 188)
            probe += 1
            await asyncio.sleep(0.05)
    finally:
        await observer.close()
        await sync.stop()
