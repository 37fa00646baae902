"""Publishing a worker's KV events: ZMQ in vLLM's exact wire format, or NATS.

ZMQ (what vLLM's ZmqEventPublisher does, so any vLLM-compatible consumer reads it):
  PUB socket, one multipart message per `publish` call: [topic, seq as 8-byte big-endian, msgpack batch];
  seq counts 0, 1, 2, ... per publisher. With a replay endpoint, a ROUTER socket keeps the last
  `buffer_steps` batches: a DEALER sends [b"", start_seq (8-byte big-endian)] and receives
  [b"", topic, seq, payload] for every buffered batch with seq >= start_seq, then the end marker
  [b"", b"", -1 as 8-byte signed big-endian, b""].
NATS: one message per batch on `subject`, payload = seq (8-byte big-endian) + msgpack batch; no replay.

`publish(events)` only puts the list on a queue, so an engine loop (any thread) pays next to
nothing; a background thread numbers, encodes and sends. Empty lists are not published.

    pub = ZmqEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    pub.endpoint, pub.replay_endpoint   # the bound addresses, for the worker to advertise
    pub.publish([BlockStored(...), BlockRemoved(...)]); ...; pub.close()
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import queue
import threading

import zmq

from router.events import KVEvent, encode_batch

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.02  # how long the ZMQ thread waits for events before it looks at replay requests


class ZmqEventPublisher:
    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:0",
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        dp_rank: int | None = None,
    ) -> None:
        if buffer_steps <= 0:
            raise ValueError(f"buffer_steps must be positive, got {buffer_steps}")
        self._topic = topic.encode("utf-8")
        self._dp_rank = dp_rank
        ctx = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.bind(endpoint)
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay: zmq.Socket | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            self._replay = ctx.socket(zmq.ROUTER)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._queue: queue.SimpleQueue[list[KVEvent] | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one engine step's events (thread-safe, non-blocking)."""
        if self._closed:
            raise RuntimeError(f"KV event publisher on {self.endpoint} is closed")
        if events:
            self._queue.put(events)

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, then stop the thread and close the sockets."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("KV event publisher thread did not stop within %.1fs", timeout)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        seqs = itertools.count()
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                events = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if events is None:
                return
            seq = next(seqs)
            payload = encode_batch(events, self._dp_rank)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignored a malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


class NatsEventPublisher:
    """The same batches over NATS (nats-py), from a thread that owns its own event loop."""

    def __init__(
        self, servers: str | list[str], subject: str, dp_rank: int | None = None, connect_timeout: float = 5.0
    ) -> None:
        import nats  # optional extra: dynamo-pd[nats]

        self.subject = subject
        self._dp_rank = dp_rank
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kv-event-nats", daemon=True)
        self._thread.start()
        connect = nats.connect(servers, connect_timeout=connect_timeout, max_reconnect_attempts=-1)
        try:
            self._nc = asyncio.run_coroutine_threadsafe(connect, self._loop).result(connect_timeout + 1)
        except Exception as exc:
            self._loop.call_soon_threadsafe(self._loop.stop)
            raise ConnectionError(
                f"cannot reach NATS at {servers} within {connect_timeout}s: {exc!r}"
            ) from exc
        self._seqs = itertools.count()
        self._closed = False

    def publish(self, events: list[KVEvent]) -> None:
        if self._closed:
            raise RuntimeError(f"NATS KV event publisher on {self.subject} is closed")
        if events:
            self._loop.call_soon_threadsafe(self._send, events)

    def _send(self, events: list[KVEvent]) -> None:
        data = next(self._seqs).to_bytes(8, "big") + encode_batch(events, self._dp_rank)
        self._loop.create_task(self._nc.publish(self.subject, data))

    def close(self, timeout: float = 2.0) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self._nc.drain(), self._loop).result(timeout)
        except Exception as exc:  # the server went away: what was not sent is lost either way
            log.warning("NATS KV event publisher on %s closed without draining: %r", self.subject, exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
