"""A worker process's HTTP endpoint on `--metrics-port` (0: a free one): `/metrics`, `/health`, `/ready`.

One per process: `python -m dynamo_pd.mocker` runs many workers in one, so every series is labelled by
`worker`. `/ready` is 200 once every worker of the process has started its engine and registered in
discovery, 503 before that and again from the moment it drains (SIGTERM): a Kubernetes readinessProbe.
`/health` is 200 while the process serves at all (a livenessProbe: a model still loading is alive).
The server is a few lines of HTTP/1.0 on the worker's event loop (the native engine steps on its own
thread, the mocker's loop yields between steps), so a scrape never waits for a forward pass.

Metrics (docs/operations/metrics.md says which engines omit which):
  dynamo_pd_worker_ready                    1 when ready as /ready says
  dynamo_pd_worker_step_seconds             histogram: one engine step (the mocker's: its profile's time)
  dynamo_pd_worker_batch_size               histogram: sequences in one engine step
  dynamo_pd_worker_requests_running         running requests (the engine's scheduler)
  dynamo_pd_worker_requests_waiting         requests waiting to be scheduled
  dynamo_pd_worker_kv_blocks_used{tier}     KV blocks in use (tier="device": the pool; "host" and "disk", the
  dynamo_pd_worker_kv_blocks_total{tier}    tiers below it: blocks they hold) and the tier's capacity
  dynamo_pd_worker_kv_tier_hits_total{tier}            blocks a lower tier served back to the pool
  dynamo_pd_worker_kv_onboarded_bytes_total{tier}      their bytes and the time copying them back took
  dynamo_pd_worker_kv_onboarded_seconds_total{tier}
  dynamo_pd_worker_kv_tier_corrupt_total{tier}         disk blocks dropped as unreadable (checksum, length)
  dynamo_pd_worker_kv_peer_pulls_total{outcome}        prefixes this worker read from a peer instead of computing
                                            them: pulled, refused (the holder was busy), failed (computed here)
  dynamo_pd_worker_kv_peer_pull_bytes_total            what the pulled ones moved, and the time they took
  dynamo_pd_worker_kv_peer_pull_seconds_total          (the hold's round trip and the read): bytes/s is their rate
  dynamo_pd_worker_kv_peer_holds_total{outcome}        peers' requests for this worker's prefixes: served, declined
  dynamo_pd_worker_kv_transfers_total{transport,direction}         finished KV transfers, in: into this
  dynamo_pd_worker_kv_transfer_bytes_total{transport,direction}    worker's blocks, out: from them; their
  dynamo_pd_worker_kv_transfer_seconds_total{transport,direction}  bytes and seconds (Begin to Finish)
  dynamo_pd_worker_handoff_failures_total{reason}   kv_transfer.agent.FAILURE_REASONS, and
                                            engine_lease_expired: held KV the decode side never came for
  dynamo_pd_worker_side_channel_malformed_total{side}   unreadable KV side-channel messages dropped
                                            (side="server": requests, "client": replies)
  dynamo_pd_worker_nixl_agents_torn_down_total   NIXL agents destroyed because a transfer would not end
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from dynamo_pd.protocol import WorkerInfo
    from kv_transfer.agent import AgentCounters

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_REQUEST_TIMEOUT_S = 5.0  # a client that has not sent its request line and headers by then is dropped
_MAX_HEADER_LINES = 100
_TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"
_TIER_LABELS = {"CPU": "host", "DISK": "disk"}  # a KV event's medium (router.events) -> the tier label


class Observed(Protocol):
    """What the endpoint reads of a worker (dynamo_pd.worker.Worker)."""

    worker_id: str

    @property
    def ready(self) -> bool: ...

    def engine_stats(self) -> Any: ...  # the engine's load snapshot (Engine.stats), None where it has none

    def transfer_counters(self) -> AgentCounters | None: ...  # None: the engine moves KV itself


class WorkerEndpoint:
    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self._step_seconds = Histogram("dynamo_pd_worker_step_seconds", "Time of one engine step",
                                       ["worker"], buckets=_STEP_BUCKETS, registry=registry)
        self._batch_size = Histogram("dynamo_pd_worker_batch_size", "Sequences in one engine step",
                                     ["worker"], buckets=_BATCH_BUCKETS, registry=registry)
        self.workers: list[Observed] = []
        registry.register(_Snapshot(self.workers))
        self._server: asyncio.Server | None = None
        self.url = ""

    def add(self, worker: Observed) -> None:
        self.workers.append(worker)

    def step_observer(self, worker_id: str) -> Callable[[float, int], None]:
        """What Engine.observe_steps calls after each step (from the engine's thread: the children lock)."""
        seconds, sequences = self._step_seconds.labels(worker_id), self._batch_size.labels(worker_id)

        def observe(step_s: float, batch: int) -> None:
            seconds.observe(step_s)
            sequences.observe(batch)

        return observe

    @property
    def ready(self) -> bool:
        return bool(self.workers) and all(worker.ready for worker in self.workers)

    async def start(self, host: str, port: int, advertise_host: str) -> str:
        """Listen on host:port (0: a free port); returns the URL peers reach it at, under advertise_host."""
        try:
            self._server = await asyncio.start_server(self._answer, host, port)
        except OSError as exc:
            raise SystemExit(f"error: the metrics endpoint cannot listen on {host}:{port}: {exc.strerror} "
                             f"(--metrics-port)") from None
        bound = self._server.sockets[0].getsockname()[1]
        self.url = f"http://{f'[{advertise_host}]' if ':' in advertise_host else advertise_host}:{bound}"
        return self.url

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(_REQUEST_TIMEOUT_S):
                method, path = await _read_request(reader)
            status, content_type, body = self._route(method, path)
            head = (f"HTTP/1.0 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                    f"Connection: close\r\n\r\n").encode()
            writer.write(head if method == "HEAD" else head + body)
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError,
                ValueError):
            pass  # a client that went away or sent no HTTP: nothing to answer
        finally:
            writer.close()

    def _route(self, method: str, path: str) -> tuple[str, str, bytes]:
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", "application/json", b'{"error": "GET or HEAD only"}'
        if path == "/metrics":
            return "200 OK", _TEXT_FORMAT, generate_latest(self.registry)
        workers = {worker.worker_id: "ready" if worker.ready else "not ready" for worker in self.workers}
        if path == "/health":
            return "200 OK", "application/json", json.dumps({"status": "ok", "workers": workers}).encode()
        if path == "/ready":
            ready = self.ready
            body = json.dumps({"status": "ready" if ready else "not ready", "workers": workers}).encode()
            return ("200 OK" if ready else "503 Service Unavailable"), "application/json", body
        return "404 Not Found", "application/json", b'{"error": "/metrics, /health or /ready"}'


def metrics_urls(frontend: str, workers: list[WorkerInfo]) -> dict[str, list[str]]:
    """Each process's /metrics URL -> what serves there (the frontend at `frontend`, the workers by id; the
    workers of one mocker process share a URL)."""
    urls: dict[str, list[str]] = {f"{frontend}/metrics": ["frontend"]}
    for info in workers:
        if info.metrics_endpoint:
            urls.setdefault(f"{info.metrics_endpoint}/metrics", []).append(info.worker_id)
    return urls


def scrape_config(urls: dict[str, list[str]], frontend_key_file: str | None = None) -> dict:
    """A Prometheus configuration scraping every process of a local deployment (`serve --prometheus-config`):
    job dynamo-pd-frontend and job dynamo-pd-workers, each target labelled with what serves there."""
    jobs: dict[str, list[dict]] = {"dynamo-pd-frontend": [], "dynamo-pd-workers": []}
    for url, names in urls.items():
        job = "dynamo-pd-frontend" if names == ["frontend"] else "dynamo-pd-workers"
        target = url.removeprefix("http://").removesuffix("/metrics")
        jobs[job].append({"targets": [target], "labels": {"process": ",".join(names)}})
    configs = [{"job_name": job, "metrics_path": "/metrics", "static_configs": targets}
               for job, targets in jobs.items()]
    if frontend_key_file:  # every frontend route but /health and /ready wants the API key
        configs[0]["authorization"] = {"type": "Bearer", "credentials_file": frontend_key_file}
    return {"global": {"scrape_interval": "5s"}, "scrape_configs": configs}


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str]:
    """The request line's method and path (no query); the headers are read and ignored."""
    method, target, _version = (await reader.readuntil(b"\n")).decode("latin-1").split()
    for _ in range(_MAX_HEADER_LINES):
        if (await reader.readuntil(b"\n")).strip() == b"":
            return method, target.partition("?")[0]
    raise ValueError("too many header lines")


def _gauge(name: str, doc: str, *labels: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"dynamo_pd_worker_{name}", doc, labels=["worker", *labels])


def _counter(name: str, doc: str, *labels: str) -> CounterMetricFamily:
    return CounterMetricFamily(f"dynamo_pd_worker_{name}", doc, labels=["worker", *labels])


class _Snapshot:
    """The series read from each worker at scrape time: the engine's load, the KV agent's counters."""

    def __init__(self, workers: list[Observed]):
        self._workers = workers

    def collect(self) -> Iterator[Metric]:
        ready = _gauge("ready", "1 once the engine started and the worker registered; 0 before, and draining")
        running = _gauge("requests_running", "Requests the engine is running")
        waiting = _gauge("requests_waiting", "Requests waiting to be scheduled")
        used = _gauge("kv_blocks_used", "KV blocks in use, per tier", "tier")
        total = _gauge("kv_blocks_total", "KV blocks, per tier", "tier")
        way = ("transport", "direction")
        transfers = _counter("kv_transfers", "Finished KV transfers (in: into this worker's blocks, out: "
                             "from them)", *way)
        moved = _counter("kv_transfer_bytes", "KV bytes moved", *way)
        seconds = _counter("kv_transfer_seconds", "Time KV transfers took, Begin to Finish", *way)
        failures = _counter("handoff_failures", "KV hand-offs that failed here, by reason", "reason")
        malformed = _counter("side_channel_malformed", "Unreadable KV side-channel messages dropped (server: "
                             "requests, client: replies)", "side")
        torn_down = _counter("nixl_agents_torn_down", "NIXL agents destroyed as a transfer would not end")
        tier_hits = _counter("kv_tier_hits", "KV blocks a lower tier served back to the pool", "tier")
        onboarded = _counter("kv_onboarded_bytes", "KV bytes copied back to the pool from a lower tier",
                             "tier")
        onboard_s = _counter("kv_onboarded_seconds", "Time copying KV back from a lower tier took", "tier")
        corrupt = _counter("kv_tier_corrupt", "Lower-tier KV blocks dropped as unreadable (checksum, length)",
                           "tier")
        pulls = _counter("kv_peer_pulls", "Prefixes read from a peer instead of computed, by outcome (pulled; "
                         "refused: the holder was busy; failed: computed here)", "outcome")
        pull_bytes = _counter("kv_peer_pull_bytes", "KV bytes the pulled prefixes moved")
        pull_s = _counter("kv_peer_pull_seconds", "Time the pulled prefixes took, the hold's round trip and the read")
        holds = _counter("kv_peer_holds", "Peers' requests for this worker's cached prefixes (served, declined)",
                         "outcome")
        for worker in self._workers:
            wid = worker.worker_id
            ready.add_metric([wid], 1.0 if worker.ready else 0.0)
            stats = worker.engine_stats()
            if stats is not None:
                running.add_metric([wid], stats.num_running)
                waiting.add_metric([wid], stats.num_waiting)
                used.add_metric([wid, "device"], stats.num_total_blocks - stats.num_free_blocks)
                total.add_metric([wid, "device"], stats.num_total_blocks)
                for use in getattr(stats, "tiers", ()):
                    tier = [wid, _TIER_LABELS[use.tier]]
                    used.add_metric(tier, use.blocks)
                    total.add_metric(tier, use.capacity)
                    tier_hits.add_metric(tier, use.hits)
                    onboarded.add_metric(tier, use.onboarded_bytes)
                    onboard_s.add_metric(tier, use.onboarded_seconds)
                    corrupt.add_metric(tier, use.corrupt)
                expiries = getattr(stats, "handoff_expiries", None)
                if expiries is not None:
                    failures.add_metric([wid, "engine_lease_expired"], expiries)
            counters = worker.transfer_counters()
            if counters is None:
                continue
            for direction, m in counters.moved.items():
                labels = [wid, counters.transport, direction]
                transfers.add_metric(labels, m.count)
                moved.add_metric(labels, m.bytes)
                seconds.add_metric(labels, m.seconds)
            for reason, count in counters.failures.items():
                failures.add_metric([wid, reason], count)
            malformed.add_metric([wid, "server"], counters.malformed_requests)
            malformed.add_metric([wid, "client"], counters.malformed_replies)
            if counters.nixl_agents_torn_down is not None:
                torn_down.add_metric([wid], counters.nixl_agents_torn_down)
            peer = counters.peer
            for outcome in ("pulled", "refused", "failed"):
                pulls.add_metric([wid, outcome], getattr(peer, outcome))
            pull_bytes.add_metric([wid], peer.bytes)
            pull_s.add_metric([wid], peer.seconds)
            holds.add_metric([wid, "served"], peer.served)
            holds.add_metric([wid, "declined"], peer.declined)
        yield from (ready, running, waiting, used, total, transfers, moved, seconds, failures, malformed,
                    torn_down, tier_hits, onboarded, onboard_s, corrupt, pulls, pull_bytes, pull_s, holds)
