"""One worker process: an engine in one role, serving requests over the request plane,
publishing KV events and load, registered in discovery under a lease.

    python -m dynamo_pd.prefill --engine native --discovery tcp://127.0.0.1:7000
    python -m dynamo_pd.decode  --engine native --discovery etcd://127.0.0.1:2379 --events nats://127.0.0.1:4222

PREFILL, --kv-handoff pull (default): each finished prefill's blocks are held by the KV transfer
agent, which frees them in the engine when the decode side has read them, reported failure, or the
lease ran out. --kv-handoff push (SGLang style): the prefill waits for the decode side to reserve
blocks under the request id, writes its KV into them with the first token, then frees its blocks.
DECODE: the engine's kv_loader pulls the blocks it lacks through the same agent, or reserves them
and waits for the push, as the request's hand-off says.
Engines that move KV themselves (vLLM's NixlConnector) hand back `KVHandoff.engine_params` and
need no agent here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import msgspec

from dynamo_pd.cli import NAMESPACE_HELP, add_engine_args, add_kv_args, check_namespace, engine_config
from dynamo_pd.engines.base import Engine, EngineConfig, EngineRole, load_engine_class
from dynamo_pd.model_store import DEFAULT_MODEL
from dynamo_pd.protocol import EngineOutput, EngineRequest, KVHandoff, LoadMetrics, WorkerInfo
from dynamo_pd.runtime import (
    DiscoveryUnavailableError,
    EventPlaneError,
    RequestContext,
    RpcServer,
    connect_discovery,
    connect_event_plane,
)
from dynamo_pd.runtime.kv_events import PlaneBatchPublisher, ZmqBatchPublisher
from dynamo_pd.runtime.tasks import cancel_and_wait
from kv_transfer.agent import KVTransferAgent
from kv_transfer.memory import KVMemory
from kv_transfer.protocol import ReleaseReason, TransferDescriptor, TransferError
from kv_transfer.transports import TransferConfig
from router.events import encode_batch

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
    host: str = "127.0.0.1"
    worker_id: str = ""
    load_interval_s: float = 0.5


class Worker:
    def __init__(self, config: WorkerConfig):
        self.config = config
        role = config.engine_config.role.value
        self.worker_id = config.worker_id or f"{role}-{uuid.uuid4().hex[:8]}"
        self.engine: Engine | None = None
        self.agent: KVTransferAgent | None = None
        self._tasks: list[asyncio.Task] = []
        self._closers: list = []
        self._pulled: dict[str, tuple[int, float]] = {}  # request id -> (KV bytes, seconds) of its pull
        self._lease_s = config.engine_config.handoff_lease_s
        self._transfer = TransferConfig(config.kv_transport, lease_s=self._lease_s)
        # A hold ends by its lease, or later by one transfer the agent pinned it for (both sides' timeouts).
        self._hold_limit_s = self._lease_s + 2 * self._transfer.timeout_s

    @property
    def role(self) -> EngineRole:
        return self.config.engine_config.role

    async def start(self) -> WorkerInfo:
        cfg = self.config
        engine_class = load_engine_class(cfg.engine)
        if cfg.kv_handoff == "push" and "push" not in engine_class.kv_handoffs:
            raise SystemExit(f"error: --kv-handoff push needs an engine whose KV this project moves; "
                             f"{cfg.engine} moves KV its own way")
        if engine_class.publishes_kv_events:  # in their own format (vLLM's ZMQ one)
            # vLLM binds only wildcard or ipc endpoints (it connects to others), and wildcard is every interface
            socket_path = Path(tempfile.gettempdir()) / f"dynamo_pd-{self.worker_id}-{uuid.uuid4().hex[:8]}.kv"
            cfg.engine_config.extra.setdefault("kv_events_endpoint", f"ipc://{socket_path}")
            cfg.engine_config.extra.setdefault("kv_events_replay_endpoint", f"ipc://{socket_path}.replay")
        loader = self._load_kv if self.role is EngineRole.DECODE and engine_class.kv_handoffs else None
        # The agent frees hand-off blocks in the engine; the engine's own lease is only the backstop for
        # a release that never comes, so it must outlast every transfer the agent still allows.
        engine_config = dataclasses.replace(cfg.engine_config, handoff_lease_s=self._hold_limit_s + 5)
        self.engine = engine = engine_class(engine_config, **({"kv_loader": loader} if loader else {}))
        await engine.start()
        self._closers.append(engine.stop)
        model_name = cfg.engine_config.model or DEFAULT_MODEL
        if engine_class.kv_handoffs:
            self.agent = KVTransferAgent(self.worker_id, KVMemory.native(engine.kv_cache, model_name), self._transfer)
            await self.agent.start()
            self._closers.insert(0, self.agent.close)
        info = WorkerInfo(
            worker_id=self.worker_id, role=self.role.value, engine=cfg.engine, model=model_name,
            rpc_endpoint="", block_size=cfg.engine_config.block_size,
            num_kv_blocks=engine.stats.num_total_blocks if engine.stats is not None else 0,
            max_num_seqs=cfg.engine_config.max_num_seqs, max_model_len=engine.max_model_len,
        )
        if self.agent is not None:
            info.kv_layout = _encoder.encode(self.agent.memory.layout)
            info.kv_endpoint, info.kv_handoff = self.agent.endpoint, cfg.kv_handoff
        self.discovery = await _connect_discovery(cfg.discovery, cfg.namespace)
        self.events = await connect_event_plane(cfg.events, self.discovery)
        self._closers[:0] = [self.events.close, self.discovery.close]
        info = self._start_event_publisher(info)
        rpc = RpcServer(self._handle, f"tcp://{cfg.host}:0")
        await rpc.start()
        self._closers.insert(0, rpc.close)
        info.rpc_endpoint = rpc.endpoint
        if engine.stats is not None:
            self._tasks.append(asyncio.create_task(self._publish_load()))
        registration = await self.discovery.register(info)
        self._closers.insert(0, registration.close)
        log.info("worker %s (%s, %s) ready at %s", self.worker_id, self.role.value, cfg.engine, rpc.endpoint)
        return info

    async def stop(self) -> None:
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
        if cfg.events:  # NATS: on the event plane, this process's one connection
            info.kv_events_subject = f"{cfg.namespace}.kv_events.{self.worker_id}"
            publisher = PlaneBatchPublisher(self.events, info.kv_events_subject)
        else:  # ZMQ: vLLM's wire, with a replay socket
            publisher = ZmqBatchPublisher(f"tcp://{cfg.host}:0", replay_endpoint=f"tcp://{cfg.host}:0")
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
            metrics = LoadMetrics(
                worker_id=self.worker_id, num_running=stats.num_running, num_waiting=stats.num_waiting,
                num_free_blocks=stats.num_free_blocks, num_total_blocks=stats.num_total_blocks,
                active_prefill_tokens=stats.num_active_prefill_tokens, **stats.costs._asdict(),
            )
            with contextlib.suppress(Exception):  # a momentary event-plane hiccup must not stop serving
                await self.events.publish(f"{self.config.namespace}.load.{self.worker_id}", _encoder.encode(metrics))
            await asyncio.sleep(self.config.load_interval_s)

    # ---- requests

    async def _handle(self, payload: bytes, context: RequestContext) -> AsyncIterator[bytes]:
        """Stream a request's outputs. PREFILL: the stream stays open until the decode side has read
        the KV, so a caller that goes away (closing the stream) frees the held blocks at once."""
        request = _request_decoder.decode(payload)
        released: asyncio.Event | None = None
        pushing: asyncio.Task | None = None
        try:
            async for out in self.engine.generate(request, context):
                if out.handoff is not None and out.handoff.engine_params is not None:
                    out.handoff.worker_id = self.worker_id  # the engine holds and moves its KV itself
                elif out.handoff is not None and self.config.kv_handoff == "push":
                    pushing = asyncio.create_task(self._push(out))  # runs while the first token streams out
                elif out.handoff is not None:
                    released = self._hold(out.handoff)
                pulled = self._pulled.pop(request.request_id, None)
                if pulled is not None:
                    out.kv_transfer_bytes, out.kv_transfer_s = pulled
                yield _encoder.encode(out)
            if released is not None:
                await asyncio.wait_for(released.wait(), self._hold_limit_s + 5)
            if pushing is not None:
                await pushing  # bounded: the rendezvous by the lease, the push by the agent's timeout
        finally:
            self._pulled.pop(request.request_id, None)
            if released is not None and not released.is_set():
                self.agent.release(request.request_id)
            if pushing is not None:
                await cancel_and_wait([pushing])

    def _hold(self, handoff: KVHandoff) -> asyncio.Event:
        engine, loop = self.engine, asyncio.get_running_loop()
        released = asyncio.Event()

        def on_release(request_id: str, reason: ReleaseReason, _payload: bytes) -> None:
            if reason is not ReleaseReason.DONE:
                log.info("hand-off of %s ended: %s", request_id, reason.value)

            def free() -> None:
                released.set()
                asyncio.ensure_future(engine.release_handoff(request_id))

            loop.call_soon_threadsafe(free)

        desc = self.agent.hold(handoff.request_id, handoff.block_ids, handoff.num_tokens, on_release)
        handoff.descriptor = _encoder.encode(desc)
        handoff.worker_id = self.worker_id
        return released

    async def _push(self, out: EngineOutput) -> None:
        """PREFILL, push mode: write the prompt's KV and the first token into the blocks the decode
        side reserved for this request id; the engine's blocks are freed whatever happens."""
        rid = out.request_id
        try:
            target = await self.agent.wait_push_target(rid, self._lease_s)
            # The decode side times the transfer from this stamp; both ends share a host clock or NTP.
            payload = _encoder.encode((out.token_ids[0], time.time()))
            await self.agent.push(target, out.handoff.block_ids, payload=payload)
        except Exception as exc:  # noqa: BLE001 - the decode side sees the failure (ERROR or its lease)
            log.warning("push of %s failed: %s", rid, exc)
        finally:
            await asyncio.shield(self.engine.release_handoff(rid))

    async def _load_kv(self, handoff: KVHandoff, local_block_ids: list[int], cached_blocks: int) -> int | None:
        if handoff.mode == "push":
            return await self._receive_push(handoff, local_block_ids, cached_blocks)
        if handoff.descriptor is None:
            raise ValueError(f"hand-off of {handoff.request_id!r} carries no transfer descriptor")
        desc = msgspec.msgpack.decode(handoff.descriptor, type=TransferDescriptor)
        start = time.perf_counter()
        moved = await self.agent.pull(desc, local_block_ids[cached_blocks:], skip_prefix_blocks=cached_blocks)
        self._pulled[handoff.request_id] = (moved, time.perf_counter() - start)
        return None

    async def _receive_push(self, handoff: KVHandoff, local_block_ids: list[int], cached_blocks: int) -> int:
        """DECODE, push mode: reserve the blocks this worker lacks, tell the prefill worker where they
        are, and wait until it has filled them; returns the first token it sent along."""
        rid, loop = handoff.request_id, asyncio.get_running_loop()
        ended: asyncio.Future = loop.create_future()

        def on_release(request_id: str, reason: ReleaseReason, payload: bytes) -> None:
            loop.call_soon_threadsafe(lambda: ended.done() or ended.set_result((reason, payload)))

        blocks = local_block_ids[cached_blocks:]
        target = self.agent.hold(rid, blocks, handoff.num_tokens, on_release, block_offset=cached_blocks,
                                 writable=True, lease_s=handoff.wait_s + self._lease_s)
        try:
            await self.agent.reserve(handoff.peer_endpoint, target)
            reason, payload = await ended
        finally:
            # A push in flight keeps writing these blocks until its Finish: wait for it (as long as the
            # agent lets a pinned transfer run) before the engine may free them.
            if self.agent.release(rid) and not ended.done():
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(ended), 2 * self._transfer.timeout_s)
        if reason is not ReleaseReason.DONE:
            raise TransferError(f"push of {rid!r} from {handoff.worker_id or 'the prefill worker'} ended: "
                                f"{reason.value}")
        first_token_id, started = msgspec.msgpack.decode(payload)
        self._pulled[rid] = (len(blocks) * self.agent.memory.layout.block_bytes, max(0.0, time.time() - started))
        return first_token_id


async def _connect_discovery(url: str, namespace: str, patience_s: float = 60.0):
    """Workers may start before the frontend hosting embedded discovery: wait for it, boundedly."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            return await connect_discovery(url, namespace=namespace)
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
    parser.add_argument("--host", default="127.0.0.1", help="address this worker binds (default 127.0.0.1)")
    parser.add_argument("--worker-id", default="")
    add_engine_args(parser)
    args, passthrough = parser.parse_known_args(argv)
    return WorkerConfig(
        engine=args.engine, engine_config=engine_config(args, role, passthrough), discovery=args.discovery,
        namespace=check_namespace(args.namespace),
        events=args.events, kv_transport=args.kv_transport, kv_handoff=args.kv_handoff, host=args.host,
        worker_id=args.worker_id,
    )


async def serve_worker(config: WorkerConfig) -> None:
    worker = Worker(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await worker.start()
        print(f"dynamo-pd {worker.role.value} worker {worker.worker_id} ready", flush=True)
        await stop.wait()
    finally:
        await worker.stop()


def main(role: EngineRole, argv: list[str] | None = None) -> None:
    import uvloop

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    uvloop.run(serve_worker(parse_args(role, argv)))
