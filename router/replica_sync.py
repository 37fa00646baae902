"""Router replicas share their placements so two routers do not pile onto one worker.

Every placement, prefill-done and finish a router makes is published as a LoadUpdate; the other
replicas apply it to their own LoadTracker under a key prefixed by the sender's router id. Workers'
LoadMetrics still correct everything (router.load), so a replica that dies leaves no lasting error;
a remote placement whose finish never arrives (lost on the way, or its replica died) expires after
`placement_ttl_s`, so they do not pile up.

Transports (the event plane): ZMQ PUB/SUB by default (each replica binds one PUB socket and connects
to the peers' endpoints), NATS (one subject) when configured.

    sync = ZmqReplicaSync(router.load, router_id="r1"); await sync.start(); sync.connect_peer(other.endpoint)
    router.attach_replica_sync(sync)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from typing import Any, Coroutine, Literal

import msgspec
import zmq
import zmq.asyncio

from router.indexer import WorkerId
from router.load import LoadTracker
from router.nats_subscribe import subscribe_live

log = logging.getLogger(__name__)


class LoadUpdate(msgspec.Struct, array_like=True, frozen=True):
    router_id: str
    kind: Literal["place", "prefill_done", "finish"]
    key: str
    worker_id: WorkerId = ""
    prefill_tokens: int = 0
    blocks: int = 0


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(LoadUpdate)


class ReplicaSync:
    def __init__(self, tracker: LoadTracker, router_id: str, placement_ttl_s: float = 600.0) -> None:
        self.tracker = tracker
        self.router_id = router_id
        self.placement_ttl_s = placement_ttl_s  # longer than any request; workers' reports correct the rest
        self.applied = 0
        self.expired = 0  # remote placements dropped because their finish never came
        self._remote: OrderedDict[str, float] = OrderedDict()  # remote placement key -> expiry, oldest first
        self._task: asyncio.Task | None = None
        self._sends: set[asyncio.Task] = set()  # referenced until done, or the loop may drop them

    def publish(
        self, kind: str, key: str, worker_id: WorkerId = "", prefill_tokens: int = 0, blocks: int = 0
    ) -> None:
        self.expire()
        self._send(_encoder.encode(LoadUpdate(self.router_id, kind, key, worker_id, prefill_tokens, blocks)))

    def apply(self, data: bytes) -> None:
        try:
            update = _decoder.decode(data)
        except msgspec.MsgspecError as exc:
            log.warning("ignored a malformed load update (%d bytes): %s", len(data), exc)
            return
        if update.router_id == self.router_id:
            return
        self.expire()
        key = f"{update.router_id}/{update.key}"
        if update.kind == "place":
            try:
                self.tracker.place(key, update.worker_id, update.prefill_tokens, update.blocks)
            except (KeyError, ValueError) as exc:  # a worker this replica has not discovered yet
                log.debug("load update from %s not applied: %s", update.router_id, exc)
                return
            self._remote[key] = time.monotonic() + self.placement_ttl_s
        elif update.kind == "prefill_done":
            self.tracker.prefill_done(key)
        else:
            self.tracker.finish(key)
            self._remote.pop(key, None)
        self.applied += 1

    def expire(self) -> None:
        """Drop remote placements older than placement_ttl_s (their finish was lost)."""
        now = time.monotonic()
        while self._remote and next(iter(self._remote.values())) < now:
            key, _ = self._remote.popitem(last=False)
            if self.tracker.finish(key):
                self.expired += 1

    def _send_soon(self, send: Coroutine[Any, Any, None]) -> None:
        """Run an async publish without making the router wait; its failure is logged."""
        task = asyncio.get_running_loop().create_task(send)
        self._sends.add(task)
        task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task) -> None:
        self._sends.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("load update of %s not shared with other replicas: %r", self.router_id, exc)

    async def stop(self) -> None:
        for task in list(self._sends):
            task.cancel()
        if self._task is not None:
            self._task.cancel()
            # failures were logged where they occurred
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        await self._close()

    def _send(self, data: bytes) -> None: ...
    async def _close(self) -> None: ...


class ZmqReplicaSync(ReplicaSync):
    def __init__(self, tracker: LoadTracker, router_id: str, endpoint: str = "tcp://127.0.0.1:0") -> None:
        super().__init__(tracker, router_id)
        ctx = zmq.asyncio.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.bind(endpoint)
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")

    def connect_peer(self, endpoint: str) -> None:
        self._sub.connect(endpoint)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"replica-sync-{self.router_id}")

    async def _run(self) -> None:
        while True:
            self.apply(await self._sub.recv())

    def _send(self, data: bytes) -> None:
        self._pub.send(data, flags=zmq.NOBLOCK)

    async def _close(self) -> None:
        self._pub.close(linger=0)
        self._sub.close(linger=0)


class NatsReplicaSync(ReplicaSync):
    def __init__(
        self,
        tracker: LoadTracker,
        router_id: str,
        servers: str | list[str],
        subject: str = "dynamo_pd.router.load",
        connect_timeout: float = 5.0,
    ) -> None:
        super().__init__(tracker, router_id)
        self.servers = servers
        self.subject = subject
        self.connect_timeout = connect_timeout
        self._nc = None

    async def start(self) -> None:
        import nats  # optional extra: dynamo-pd[nats]

        self._nc = await nats.connect(
            self.servers, connect_timeout=self.connect_timeout, max_reconnect_attempts=-1
        )

        async def on_message(msg) -> None:
            self.apply(msg.data)

        await subscribe_live(self._nc, [self.subject], on_message, self.connect_timeout)

    def _send(self, data: bytes) -> None:
        self._send_soon(self._nc.publish(self.subject, data))

    async def _close(self) -> None:
        if self._nc is not None:
            await self._nc.close()
            self._nc = None
