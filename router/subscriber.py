"""Subscribing to one worker's KV events and feeding them, in order, to an EventIngestor.

ZmqEventSubscriber reads [topic, seq, payload] from a worker's PUB endpoint (vLLM, the native
engine through router.publisher, any vLLM-compatible engine). With a replay endpoint it first
fetches what was published before it joined. When a batch is missing (a gap in seq) it asks the
replay endpoint for everything from the first missing seq. A gap shows only when a later batch
arrives, so a stream quiet for a second also asks the replay endpoint: batches published while the
subscription was still forming (ZMQ's slow joiner) or the last batch of a burst lost on the way
are found then, not at the next event. If there is no replay endpoint, the
replay times out, or the worker's buffer no longer reaches back far enough, the worker's state is
dropped and rebuilt from the events that follow (EventIngestor.reset_worker). Either way the
indexer never keeps state that may have diverged from the engine's.
vLLM binds its PUB endpoint only for ipc://, inproc:// and tcp://* addresses (it connects to the
rest); our publisher always binds.

NatsEventSubscriber does the same for router.publisher.NatsEventPublisher's messages (no replay).

Both run as asyncio tasks on the router's loop: `await sub.start()`, `await sub.stop()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import zmq
import zmq.asyncio

from router.events import EventDecodeError
from router.ingest import Delivery, EventIngestor
from router.indexer import WorkerId
from router.nats_subscribe import subscribe_live
from router.publisher import END_SEQ

log = logging.getLogger(__name__)

_QUIET_CATCH_UP_S = 1.0  # a ZMQ stream silent this long checks the replay buffer for missed batches


class EventSubscriber:
    """Ordering and recovery shared by the transports; subclasses feed `_on_batch`."""

    def __init__(self, ingestor: EventIngestor, worker_id: WorkerId) -> None:
        self.ingestor = ingestor
        self.worker_id = worker_id
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError(f"subscriber for worker {self.worker_id!r} already started")
        await self._open()
        self._task = asyncio.create_task(self._serve(), name=f"kv-events-{self.worker_id}")

    def cancel(self) -> None:
        """Stop without waiting (the task closes its connection as it ends)."""
        if self._task is not None:
            self._task.cancel()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            # failures were logged where they occurred
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    async def _serve(self) -> None:
        try:
            await self._run()
        except Exception:
            log.exception("worker %s: KV event subscriber stopped", self.worker_id)
            raise
        finally:
            await self._close()

    async def _on_batch(self, seq: int, payload: bytes) -> None:
        worker = self.worker_id
        try:
            if self.ingestor.deliver(worker, seq, payload) is not Delivery.GAP:
                return
            expected = self.ingestor.expected_seq(worker)
            log.warning("worker %s: KV event batches %d..%d missing", worker, expected, seq - 1)
            if (
                not await self._catch_up(expected)
                or self.ingestor.deliver(worker, seq, payload) is Delivery.GAP
            ):
                self.ingestor.reset_worker(worker)
                self.ingestor.deliver(worker, seq, payload)
        except EventDecodeError as exc:
            # A batch we cannot read is a batch we missed: nothing after it can be trusted.
            log.error("worker %s: undecodable KV event batch %d (%s): dropping its state", worker, seq, exc)
            self.ingestor.reset_worker(worker)

    async def _catch_up(self, start_seq: int) -> bool:
        """Replay batches from `start_seq` on (rebuilding from scratch when the worker's buffer no longer
        reaches back that far); False when there is no replay or it fails."""
        return False

    async def _open(self) -> None: ...
    async def _close(self) -> None: ...
    async def _run(self) -> None: ...


class ZmqEventSubscriber(EventSubscriber):
    def __init__(
        self,
        ingestor: EventIngestor,
        worker_id: WorkerId,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        replay_timeout: float = 2.0,
    ) -> None:
        super().__init__(ingestor, worker_id)
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode("utf-8")
        self.replay_timeout = replay_timeout
        self._ctx = zmq.asyncio.Context.instance()
        self._sub: zmq.asyncio.Socket | None = None

    async def _open(self) -> None:
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self._sub.connect(self.endpoint)

    async def _close(self) -> None:
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None

    async def _run(self) -> None:
        if self.replay_endpoint is not None:  # a late joiner first fetches what it missed
            await self._catch_up(self.ingestor.expected_seq(self.worker_id) or 0)
        while True:
            if self.replay_endpoint is not None and not await self._sub.poll(_QUIET_CATCH_UP_S * 1000):
                await self._catch_up(self.ingestor.expected_seq(self.worker_id) or 0)
                continue
            frames = await self._sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                log.warning(
                    "worker %s: ignored a malformed KV event message (%d frames)", self.worker_id, len(frames)
                )
                continue
            await self._on_batch(int.from_bytes(frames[1], "big"), frames[2])

    async def _catch_up(self, start_seq: int) -> bool:
        if self.replay_endpoint is None:
            return False
        worker = self.worker_id
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart((b"", start_seq.to_bytes(8, "big")))
            while True:
                # dealer.poll, not asyncio.wait_for: on Python < 3.12 wait_for can swallow a cancellation
                if not await dealer.poll(self.replay_timeout * 1000):
                    log.warning(
                        "worker %s: replay from %s timed out after %.1fs",
                        worker,
                        self.replay_endpoint,
                        self.replay_timeout,
                    )
                    return False
                frames = await dealer.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    log.warning("worker %s: malformed replay reply (%d frames)", worker, len(frames))
                    return False
                if frames[2] == END_SEQ:
                    return True
                self._deliver_replayed(int.from_bytes(frames[2], "big"), frames[3])
        finally:
            dealer.close(linger=0)

    def _deliver_replayed(self, seq: int, payload: bytes) -> None:
        worker = self.worker_id
        try:
            if self.ingestor.deliver(worker, seq, payload, live=False) is Delivery.GAP:
                log.warning(
                    "worker %s: replay buffer starts at %d, after the missing batch %s: rebuilding "
                    "its state from there",
                    worker,
                    seq,
                    self.ingestor.expected_seq(worker),
                )
                self.ingestor.reset_worker(worker)
                self.ingestor.deliver(worker, seq, payload, live=False)
        except EventDecodeError as exc:
            log.error("worker %s: undecodable replayed batch %d (%s): dropping its state", worker, seq, exc)
            self.ingestor.reset_worker(worker)


class NatsEventSubscriber(EventSubscriber):
    def __init__(
        self,
        ingestor: EventIngestor,
        worker_id: WorkerId,
        servers: str | list[str],
        subject: str,
        connect_timeout: float = 5.0,
    ) -> None:
        super().__init__(ingestor, worker_id)
        self.servers = servers
        self.subject = subject
        self.connect_timeout = connect_timeout
        self._nc = None
        self._queue: asyncio.Queue = asyncio.Queue()

    async def _open(self) -> None:
        import nats  # optional extra: dynamo-pd[nats]

        self._nc = await nats.connect(
            self.servers, connect_timeout=self.connect_timeout, max_reconnect_attempts=-1
        )
        await subscribe_live(self._nc, [self.subject], self._queue.put, self.connect_timeout)

    async def _close(self) -> None:
        if self._nc is not None:
            await self._nc.close()
            self._nc = None

    async def _run(self) -> None:
        while True:
            data = (await self._queue.get()).data
            if len(data) < 8:
                log.warning("worker %s: ignored a %d-byte NATS KV event message", self.worker_id, len(data))
                continue
            await self._on_batch(int.from_bytes(data[:8], "big"), data[8:])
