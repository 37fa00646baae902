"""One worker process: an engine in one role, serving requests over the request plane,
publishing KV events and load, registered in discovery under a lease.

    python -m dynamo_pd.prefill --engine native --discovery tcp://127.0.0.1:7000
    python -m dynamo_pd.decode  --engine native --discovery etcd://127.0.0.1:2379 --events nats://127.0.0.1:4222

The hand-off (pull, or push with --kv-handoff push; an engine's own) is dynamo_pd.handoff's
HandoffManager: this module only wires the engine, the manager, the event publisher, load and the
registration together. Its /metrics, /health and /ready are dynamo_pd.worker_metrics's, on --metrics-port.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import signal
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from dynamo_pd import tracing
from dynamo_pd.cli import NAMESPACE_HELP, add_engine_args, add_kv_args, check_namespace, engine_config
from dynamo_pd.credentials import add_security_args, security_from_args
from dynamo_pd.engines.base import Engine, EngineConfig, EngineRole, load_engine_class
from dynamo_pd.handoff import HandoffManager
from dynamo_pd.model_store import DEFAULT_MODEL
from dynamo_pd.protocol import EngineOutput, EngineRequest, LoadMetrics, WorkerInfo
from dynamo_pd.runtime import (
    DiscoveryUnavailableError,
    EventPlaneError,
    RequestContext,
    RpcServer,
    connect_discovery,
    connect_event_plane,
)
from dynamo_pd.runtime.kv_events import PlaneBatchPublisher, ZmqBatchPublisher
from dynamo_pd.runtime.ports import advertise_host
from dynamo_pd.runtime.security import Security
from dynamo_pd.runtime.tasks import cancel_and_wait
from dynamo_pd.tracing import TracingConfig
from dynamo_pd.worker_metrics import WorkerEndpoint
from router.events import encode_batch
from router.load import FetchCosts

if TYPE_CHECKING:
    from kv_transfer.agent import AgentCounters

log = logging.getLogger("dynamo_pd.worker")

_EVENT_FLUSH_S = 0.01  # how often the engine's KV events are handed to the publisher
_request_decoder = msgspec.msgpack.Decoder(EngineRequest)
_encoder = msgspec.msgpack.Encoder()


@dataclass
class WorkerConfig:
    engine: str
    engine_config: EngineConfig
    discovery: str
    namespace: str = "dynamo_pd"
    events: str | None = None  # nats://... ; None: ZMQ
    kv_transport: str = "zmq"
    kv_handoff: str = "pull"  # PREFILL: "pull" or "push"
    host: str = "127.0.0.1"  # every plane binds it
    advertise_host: str = ""  # and registers this address ("": host, or the route to discovery for a wildcard)
    security: Security = field(default_factory=Security)  # the cluster secret's CURVE keys, NATS / etcd credentials
    worker_id: str = ""
    served_model_name: str = ""  # the model's name for clients ("": --model, or the default model's name)
    load_interval_s: float = 0.5
    drain_timeout_s: float = 30.0  # SIGTERM: how long in-flight requests may finish before they are moved
    metrics_port: int = 0  # /metrics, /health and /ready on --host (0: a free port)
    tracing: TracingConfig = field(default_factory=TracingConfig)  # --otlp-endpoint


class Worker:
    def __init__(self, config: WorkerConfig, endpoint: WorkerEndpoint | None = None):
        self.config = config
        role = config.engine_config.role.value
        self.worker_id = config.worker_id or f"{role}-{uuid.uuid4().hex[:8]}"
        self.engine: Engine | None = None
        self.advertise_host = advertise_host(config.host, config.advertise_host, config.discovery)
        self.handoff = HandoffManager(self.worker_id, config.engine_config.handoff, config.kv_transport,
                                      offer_push=config.kv_handoff == "push", host=config.host,
                                      advertise_host=self.advertise_host, guard=config.security)
        self._tasks: list[asyncio.Task] = []
        self._closers: list = []
        self._rpc: RpcServer | None = None
        self._registration = None
        self._draining = False
        self.endpoint = endpoint  # the process's metrics endpoint (mocker processes share one)
        if endpoint is not None:
            endpoint.add(self)

    @property
    def role(self) -> EngineRole:
        return self.config.engine_config.role

    @property
    def ready(self) -> bool:
        """The engine started and the worker is registered, and not draining (the endpoint's /ready)."""
        return self._registration is not None and not self._draining

    def engine_stats(self) -> Any:
        return self.engine.stats if self.engine is not None else None

    def transfer_counters(self) -> AgentCounters | None:
        return self.handoff.agent.counters() if self.handoff.agent is not None else None

    async def start(self) -> WorkerInfo:
        cfg = self.config
        engine_class = load_engine_class(cfg.engine)
        if cfg.kv_handoff == "push" and "push" not in engine_class.kv_handoffs:
            raise SystemExit(f"error: --kv-handoff push needs an engine whose KV this project moves; "
                             f"{cfg.engine} moves KV its own way")
        if engine_class.publishes_kv_events:  # in their own format (vLLM's ZMQ one)
            # vLLM binds only wildcard or ipc endpoints (it connects to others), and wildcard is every interface
            path = Path(tempfile.gettempdir()) / f"dynamo_pd-{self.worker_id}-{uuid.uuid4().hex[:8]}.kv"
            for key, socket_path in (("kv_events_endpoint", path), ("kv_events_replay_endpoint",
                                                                   path.with_suffix(".kv.replay"))):
                if key not in cfg.engine_config.extra:  # ours: the engine's process may leave the file behind
                    cfg.engine_config.extra[key] = f"ipc://{socket_path}"
                    self._closers.append(functools.partial(socket_path.unlink, missing_ok=True))
        loads = self.role is EngineRole.DECODE and engine_class.kv_handoffs
        self.engine = engine = engine_class(cfg.engine_config, **({"kv_loader": self.handoff.load_kv} if loads else {}))
        await engine.start()
        self._closers.append(engine.stop)
        if self.endpoint is not None:
            engine.observe_steps(self.endpoint.step_observer(self.worker_id))
        model_name = cfg.engine_config.model or DEFAULT_MODEL
        await self.handoff.start(engine, model_name)
        self._closers.insert(0, self.handoff.close)
        info = self.handoff.register(WorkerInfo(
            worker_id=self.worker_id, role=self.role, engine=cfg.engine, model=cfg.served_model_name or model_name,
            model_path=model_name, rpc_endpoint="", block_size=cfg.engine_config.block_size,
            num_kv_blocks=engine.stats.num_total_blocks if engine.stats is not None else 0,
            max_num_seqs=cfg.engine_config.max_num_seqs, max_model_len=engine.max_model_len,
            resumes=engine_class.resumes, metrics_endpoint=self.endpoint.url if self.endpoint else "",
        ))
        self.discovery = await _connect_discovery(cfg.discovery, cfg.namespace, cfg.security)
        self.events = await connect_event_plane(cfg.events, self.discovery, host=cfg.host,
                                                advertise_host=self.advertise_host, security=cfg.security)
        self._closers[:0] = [self.events.close, self.discovery.close]
        info = self._start_event_publisher(info)
        rpc = RpcServer(self._handle, f"tcp://{cfg.host}:0", advertise_host=self.advertise_host,
                        security=cfg.security)
        await rpc.start()
        self._closers.insert(0, rpc.close)
        self._rpc = rpc
        info.rpc_endpoint = rpc.endpoint
        if engine.stats is not None:
            self._tasks.append(asyncio.create_task(self._publish_load()))
        self._registration = registration = await self.discovery.register(info)
        self._closers.insert(0, registration.close)
        log.info("worker %s (%s, %s) ready at %s", self.worker_id, self.role.value, cfg.engine, rpc.endpoint)
        return info

    async def drain(self) -> None:
        """Leave discovery (routers stop sending here), refuse new requests, let those in flight finish
        for up to drain_timeout_s, then end the rest with WorkerDrainingError: the frontend moves them, and
        their new workers may read the KV they computed here, which the worker lends until they have."""
        if self._registration is None or self._rpc is None:
            return
        self._draining = True  # /ready answers 503 from now: a load balancer stops sending too
        await self._registration.close()
        log.info("worker %s draining: %d requests in flight, up to %gs", self.worker_id, self._rpc.num_streams,
                 self.config.drain_timeout_s)
        cut = await self._rpc.drain(self.config.drain_timeout_s)
        if cut:
            log.warning("worker %s: drain timeout ended %d requests; the frontend moves them", self.worker_id, cut)
            lent = await self.handoff.lend_while_draining(cut)
            log.info("worker %s: %d of them read their KV from here", self.worker_id, lent)

    async def stop(self) -> None:
        self._draining = True
        await cancel_and_wait(self._tasks)
        for close in self._closers:
            with contextlib.suppress(Exception):
                result = close()
                if asyncio.iscoroutine(result):
                    await result

    # ---- KV events and load

    def _start_event_publisher(self, info: WorkerInfo) -> WorkerInfo:
        cfg = self.config
        if self.engine.publishes_kv_events:
            extra = cfg.engine_config.extra
            info.kv_events_endpoint = extra["kv_events_endpoint"]
            info.kv_events_replay_endpoint = extra["kv_events_replay_endpoint"]
            return info
        publisher: PlaneBatchPublisher | ZmqBatchPublisher
        info.kv_project_hashes = self.engine.project_hashes
        if cfg.events:  # NATS: on the event plane, this process's one connection
            info.kv_events_subject = f"{cfg.namespace}.kv_events.{self.worker_id}"
            publisher = PlaneBatchPublisher(self.events, info.kv_events_subject)
        else:  # ZMQ: vLLM's wire, with a replay socket
            publisher = ZmqBatchPublisher(f"tcp://{cfg.host}:0", replay_endpoint=f"tcp://{cfg.host}:0",
                                          advertise_host=self.advertise_host, security=cfg.security)
            info.kv_events_endpoint, info.kv_events_replay_endpoint = publisher.endpoint, publisher.replay_endpoint
            self._closers.append(publisher.close)
        self._tasks.append(asyncio.create_task(self._flush_events(publisher)))
        return info

    async def _flush_events(self, publisher: PlaneBatchPublisher | ZmqBatchPublisher) -> None:
        while True:
            if events := self.engine.drain_kv_events():
                # a batch the event plane fails to send is a gap the router sees, and it rebuilds
                with contextlib.suppress(EventPlaneError):
                    await publisher.publish(encode_batch(events))
            await asyncio.sleep(_EVENT_FLUSH_S)

    async def _publish_load(self) -> None:
        while True:
            stats = self.engine.stats
            counted_at = getattr(stats, "counted_at", None)
            metrics = LoadMetrics(
                worker_id=self.worker_id, num_running=stats.num_running, num_waiting=stats.num_waiting,
                num_free_blocks=stats.num_free_blocks, num_total_blocks=stats.num_total_blocks,
                active_prefill_tokens=stats.num_active_prefill_tokens,
                counted_s_ago=0.0 if counted_at is None else max(0.0, time.monotonic() - counted_at),
                **stats.costs._asdict(),
                **getattr(stats, "fetch", FetchCosts())._asdict(),
            )
            with contextlib.suppress(Exception):  # a momentary event-plane hiccup must not stop serving
                await self.events.publish(f"{self.config.namespace}.load.{self.worker_id}", _encoder.encode(metrics))
            await asyncio.sleep(self.config.load_interval_s)

    # ---- requests

    async def _handle(self, payload: bytes, context: RequestContext) -> AsyncIterator[bytes]:
        """Stream a request's outputs, its hand-off done by the manager (a PREFILL stream stays open
        until the decode side has the KV, so a caller that goes away frees the held blocks at once)."""
        request = _request_decoder.decode(payload)
        self.engine.check_served(request)  # a field its engine does not apply is a 400 naming it
        trace = tracing.extract(context.metadata)  # None unless both the caller and this process trace it
        if trace is None:
            outputs = self.handoff.serve(request, self.engine.generate(request, context))
        else:
            outputs = self._traced(request, context, trace)
        async for out in outputs:
            yield _encoder.encode(out)

    async def _traced(self, request: EngineRequest, context: RequestContext, trace: Any,
                      ) -> AsyncIterator[EngineOutput]:
        """The request's outputs under this worker's span: prefill (until its first output: the hand-off's
        own span follows beside it), decode (with the KV transfer under it) or generate (aggregated)."""
        name = {EngineRole.PREFILL: "prefill", EngineRole.DECODE: "decode"}.get(self.role, "generate")
        stats = self.engine.stats
        span = tracing.start(name, trace, {
            "dynamo_pd.worker_id": self.worker_id, "dynamo_pd.engine": self.config.engine,
            "dynamo_pd.request_id": request.request_id,
            "dynamo_pd.prompt_tokens": len(request.prompt_token_ids),
            "dynamo_pd.resume_tokens": len(request.resume_token_ids),
            "dynamo_pd.handoff": type(request.handoff).__name__ if request.handoff is not None else "none",
            # what the request queues behind as it arrives
            **({"dynamo_pd.engine.running": stats.num_running, "dynamo_pd.engine.waiting": stats.num_waiting}
               if stats is not None else {})})
        context.metadata = tracing.carrier(span)  # an engine that traces (vLLM, SGLang) continues under it
        prefill = self.role is EngineRole.PREFILL
        first = True
        try:
            outputs = self.handoff.serve(request, self.engine.generate(request, context),
                                         trace if prefill else tracing.under(span))
            async for out in outputs:
                if out.finish_reason == "error":
                    tracing.end(span, out.error or "generation failed")
                if first and (out.token_ids or out.finish_reason):
                    first = False
                    if out.usage is not None:
                        span.set_attribute("dynamo_pd.cached_tokens", out.usage.cached_tokens)
                    if prefill:
                        tracing.end(span)
                    else:
                        span.add_event("first_token")
                yield out
        except Exception as exc:
            tracing.end(span, exc)
            raise
        finally:
            tracing.end(span)


async def _connect_discovery(url: str, namespace: str, security: Security, patience_s: float = 60.0):
    """Workers may start before the frontend hosting embedded discovery: wait for it, boundedly."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            discovery = await connect_discovery(url, namespace=namespace, security=security)
            try:  # the embedded store connects lazily: one round trip shows the frontend is listening
                await discovery.list(WorkerInfo)
            except BaseException:
                await discovery.close()
                raise
            return discovery
        except DiscoveryUnavailableError:
            if time.monotonic() > deadline:
                raise SystemExit(f"error: discovery at {url} unreachable for {patience_s:.0f}s (--discovery)") from None
            await asyncio.sleep(1.0)


def parse_args(role: EngineRole, argv: list[str] | None = None) -> WorkerConfig:
    parser = argparse.ArgumentParser(prog=f"python -m dynamo_pd.{role.value}",
                                     description=f"A dynamo-pd {role.value} worker.")
    parser.add_argument("--discovery", default="tcp://127.0.0.1:7000",
                        help="tcp://HOST:PORT of the frontend's embedded discovery, or etcd://HOST:PORT")
    parser.add_argument("--namespace", default="dynamo_pd", help=NAMESPACE_HELP)
    parser.add_argument("--events", default=None, help="nats://HOST:PORT to carry events over NATS (default: ZMQ)")
    add_kv_args(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address every plane of this worker binds (default 127.0.0.1; 0.0.0.0: every interface)")
    parser.add_argument("--advertise-host", default="",
                        help="address peers reach this worker at (default: --host, or for 0.0.0.0 this host's "
                             "address on the route to discovery)")
    parser.add_argument("--worker-id", default="")
    parser.add_argument("--drain-timeout-s", type=float, default=WorkerConfig.drain_timeout_s,
                        help="on SIGTERM: leave discovery, let in-flight requests finish this long, then end the "
                             "rest so the frontend continues them on another worker (default %(default)s)")
    parser.add_argument("--served-model-name", default="",
                        help="the name clients ask for this model by (default: --model)")
    parser.add_argument("--metrics-port", type=int, default=WorkerConfig.metrics_port,
                        help="serve /metrics (Prometheus), /health and /ready on --host at this port (default "
                             "0: a free port, printed in the ready line and registered in discovery)")
    add_security_args(parser)
    tracing.add_args(parser)
    add_engine_args(parser)
    args, passthrough = parser.parse_known_args(argv)
    if args.drain_timeout_s < 0:
        raise SystemExit(f"error: --drain-timeout-s must be >= 0, got {args.drain_timeout_s}")
    if not 0 <= args.metrics_port <= 65535:
        raise SystemExit(f"error: --metrics-port must be in [0, 65535], got {args.metrics_port}")
    try:
        args.advertise_host = advertise_host(args.host, args.advertise_host, args.discovery)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    return WorkerConfig(
        engine=args.engine, engine_config=engine_config(args, role, passthrough), discovery=args.discovery,
        namespace=check_namespace(args.namespace),
        events=args.events, kv_transport=args.kv_transport, kv_handoff=args.kv_handoff, host=args.host,
        advertise_host=args.advertise_host, security=security_from_args(args), worker_id=args.worker_id,
        served_model_name=args.served_model_name, drain_timeout_s=args.drain_timeout_s,
        metrics_port=args.metrics_port, tracing=tracing.config_from_args(parser, args),
    )


async def start_endpoint(config: WorkerConfig) -> WorkerEndpoint:
    """The process's metrics endpoint, listening before the engine loads (/health answers, /ready is 503)."""
    endpoint = WorkerEndpoint()
    await endpoint.start(config.host, config.metrics_port,
                         advertise_host(config.host, config.advertise_host, config.discovery))
    return endpoint


async def serve_worker(config: WorkerConfig) -> None:
    endpoint = await start_endpoint(config)
    worker = Worker(config, endpoint)
    tracing.setup(config.tracing, f"dynamo-pd-{worker.role.value}", worker.worker_id)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals: list[signal.Signals] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda sig=sig: (signals.append(sig), stop.set()))
    try:
        await worker.start()
        print(f"dynamo-pd {worker.role.value} worker {worker.worker_id} ready "
              f"(metrics {endpoint.url}/metrics)", flush=True)
        await stop.wait()
        if signals[0] is signal.SIGTERM:  # a rolling restart: in-flight work finishes or moves
            await worker.drain()
    finally:
        await worker.stop()
        await endpoint.close()
        tracing.shutdown()  # what is still queued is exported


def main(role: EngineRole, argv: list[str] | None = None) -> None:
    import uvloop

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    uvloop.run(serve_worker(parse_args(role, argv)))
