"""KV event streams: one worker's numbered batches of bytes, replayable where the transport can.

This module moves (sequence number, payload) pairs; what a payload means (router.events) and the
order batches are applied in, with gap detection and replay (router.ingest), are the router's.

ZMQ, vLLM's wire (vllm.distributed.kv_events.ZmqEventPublisher), so a vLLM engine's own publisher
and ours are read alike:
  PUB: one multipart message per batch, [topic, seq as 8-byte big-endian, payload]; seq counts 0, 1, ...;
  ours sends the empty topic (vLLM's default); the subscriber takes every topic.
  replay ROUTER: keeps the last `buffer_steps` batches; a DEALER sends [b"", start_seq (8 bytes)] and
  gets [b"", topic, seq, payload] for each buffered batch with seq >= start_seq, then the end marker
  [b"", b"", -1 as 8-byte signed big-endian, b""].
  vLLM binds its PUB endpoint only for ipc://, inproc:// and tcp://* (it connects to the rest); ours binds.
Event plane (NATS): one message per batch on the worker's subject, seq (8 bytes) + payload, riding the
process's one event-plane connection; no replay.
With a cluster secret (runtime.security) the tcp:// sockets speak CURVE; ipc:// ones (a vLLM engine's
own publisher, which speaks no CURVE) stay plaintext: a socket file of one host, guarded by its permissions.

    pub = ZmqBatchPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0"); ...; await pub.close()
    pub = ZmqBatchPublisher("tcp://0.0.0.0:0", "tcp://0.0.0.0:0", advertise_host="10.0.0.2")  # every interface
    pub = PlaneBatchPublisher(events, subject)    # nothing to close: the event plane is the process's
    await pub.publish(payload)
    source = ZmqBatchSource(endpoint, replay_endpoint)            # or await PlaneBatchSource.subscribe(...)
    await source.next(timeout_s)   # (seq, payload), or None when nothing came within timeout_s
    await source.replay(start)     # [(seq, payload), ...] from start on, None when it fails; None: no replay
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging

import zmq
import zmq.asyncio

from dynamo_pd.runtime.events import EventPlane, Subscription
from dynamo_pd.runtime.ports import advertised
from dynamo_pd.runtime.security import CONTROL_MAX_BYTES, KV_EVENTS_MAX_BYTES, Security, current
from dynamo_pd.runtime.tasks import cancel_and_wait
from dynamo_pd.runtime.zmq_send import send_now

log = logging.getLogger(__name__)

Batch = tuple[int, bytes]
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _for(endpoint: str, security: Security | None) -> Security:
    return Security() if endpoint.startswith("ipc://") else security or current()


def _seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


class ZmqBatchPublisher:
    def __init__(self, endpoint: str = "tcp://127.0.0.1:0", replay_endpoint: str | None = None,
                 buffer_steps: int = 10_000, hwm: int = 100_000, *, advertise_host: str = "",
                 security: Security | None = None) -> None:
        if buffer_steps <= 0:
            raise ValueError(f"buffer_steps must be positive, got {buffer_steps}")
        security = _for(endpoint, security)
        ctx = zmq.asyncio.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.linger, self._pub.sndhwm = 0, hwm
        security.server(self._pub, CONTROL_MAX_BYTES)  # it receives only subscriptions
        self._pub.bind(endpoint)
        self.endpoint: str = advertised(self._pub.getsockopt_string(zmq.LAST_ENDPOINT), advertise_host)
        self.replay_endpoint: str | None = None
        self._tasks: list[asyncio.Task] = []
        if replay_endpoint is not None:
            self._replay = ctx.socket(zmq.ROUTER)
            self._replay.linger = 0
            self._replay.sndhwm = buffer_steps + 1  # a whole replay fits: never dropped
            security.server(self._replay, CONTROL_MAX_BYTES)  # it receives only replay requests
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = advertised(self._replay.getsockopt_string(zmq.LAST_ENDPOINT), advertise_host)
            self._tasks.append(asyncio.create_task(self._serve_replay(), name="kv-events-replay"))
        self._buffer: collections.deque[Batch] = collections.deque(maxlen=buffer_steps)
        self._seqs = itertools.count()
        self._closed = False

    async def publish(self, payload: bytes) -> None:
        if self._closed:
            raise RuntimeError(f"KV event publisher on {self.endpoint} is closed")
        seq = next(self._seqs)
        send_now(self._pub, [b"", _seq(seq), payload])  # a PUB never blocks: past its HWM it drops
        self._buffer.append((seq, payload))

    async def _serve_replay(self) -> None:
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("ignored a malformed replay request (%d frames)", len(frames))
                continue
            client, start_seq = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in self._buffer:
                if seq >= start_seq:
                    send_now(self._replay, [client, b"", b"", _seq(seq), payload])
            send_now(self._replay, [client, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await cancel_and_wait(self._tasks)
        self._pub.close()
        if self.replay_endpoint is not None:
            self._replay.close()


class ZmqBatchSource:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None,
                 replay_timeout_s: float = 2.0, *, security: Security | None = None) -> None:
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.replay = self._replay if replay_endpoint is not None else None
        self._replay_timeout_s = replay_timeout_s
        self._security = _for(endpoint, security)
        self._sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self._sub.linger = 0
        self._security.client(self._sub, KV_EVENTS_MAX_BYTES)
        self._sub.subscribe(b"")
        self._sub.connect(endpoint)

    async def next(self, timeout_s: float | None = None) -> Batch | None:
        while True:
            if timeout_s is not None and not await self._sub.poll(timeout_s * 1000):
                return None
            frames = await self._sub.recv_multipart()
            if len(frames) == 3 and len(frames[1]) == 8:
                return int.from_bytes(frames[1], "big"), frames[2]
            log.warning("%s: ignored a malformed KV event message (%d frames)", self.endpoint, len(frames))

    async def _replay(self, start_seq: int) -> list[Batch] | None:
        dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        dealer.linger = 0
        self._security.client(dealer, KV_EVENTS_MAX_BYTES)
        dealer.connect(self.replay_endpoint)
        batches: list[Batch] = []
        try:
            with contextlib.suppress(zmq.Again):  # no peer yet: the poll below times out
                send_now(dealer, [b"", _seq(start_seq)])
            while True:
                if not await dealer.poll(self._replay_timeout_s * 1000):
                    log.warning("replay from %s timed out after %.1fs", self.replay_endpoint,
                                self._replay_timeout_s)
                    return None
                frames = await dealer.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    log.warning("malformed replay reply from %s (%d frames)", self.replay_endpoint,
                                len(frames))
                    return None
                if frames[2] == END_SEQ:
                    return batches
                batches.append((int.from_bytes(frames[2], "big"), frames[3]))
        finally:
            dealer.close()

    async def close(self) -> None:
        self._sub.close()


class PlaneBatchPublisher:
    def __init__(self, events: EventPlane, subject: str) -> None:
        self._events, self.subject = events, subject
        self._seqs = itertools.count()

    async def publish(self, payload: bytes) -> None:
        # numbered before it is sent: a publish that fails is a gap the router sees, never a silent loss
        await self._events.publish(self.subject, _seq(next(self._seqs)) + payload)


class PlaneBatchSource:
    replay = None  # the event plane keeps nothing to replay

    def __init__(self, subscription: Subscription) -> None:
        self._subscription = subscription

    @classmethod
    async def subscribe(cls, events: EventPlane, subject: str) -> PlaneBatchSource:
        """Live once this returns (NATS: the server has the subscription)."""
        return cls(await events.subscribe(subject))

    async def next(self, timeout_s: float | None = None) -> Batch | None:
        while True:
            try:
                async with asyncio.timeout(timeout_s):
                    _, data = await anext(self._subscription)
            except asyncio.TimeoutError:
                return None
            if len(data) >= 8:
                return int.from_bytes(data[:8], "big"), data[8:]
            log.warning("%s: ignored a %d-byte KV event message", self._subscription.prefix, len(data))

    async def close(self) -> None:
        await self._subscription.close()
