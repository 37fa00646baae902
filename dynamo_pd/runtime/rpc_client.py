"""Request plane, frontend side: streaming RPC to workers, many streams on one connection per worker.

    client = RpcClient()
    context = RequestContext(request_id)
    async for chunk in client.stream(worker.rpc_endpoint, payload, context):
        ...                                   # bytes, as the worker's handler yielded them
    await client.close()

Every way out is bounded and typed:
  - the handler refused the request               -> InvalidRequestError (the client's fault)
  - the worker is draining (refused a new stream, or its drain timeout ended this one) -> WorkerDrainingError
  - the handler raised anything else              -> RemoteError(error_type, message)
  - the connection was refused, none within `connect_timeout_s`, or it dropped (the worker died: ZMQ
    heartbeats, answered by ZMQ's I/O thread so a busy worker loop is no false alarm, notice a
    silent peer within `heartbeat_timeout_s`)  -> WorkerGoneError
  - nothing within `first_response_timeout_s`      -> FirstResponseTimeoutError (the stream is cancelled)
  - then nothing for `inter_response_timeout_s`    -> StreamStalledError (the stream is cancelled)
  - `context.cancel()` while streaming             -> RequestCancelledError
`context.metadata` goes with the call: the handler's context has it.
Leaving the loop early (break, aclose, the consuming task cancelled) or any of the errors above
sends a Cancel, so the worker's context is cancelled and it aborts the work.
`stream_batches` yields the same chunks as lists: every chunk that had arrived when the caller asked, so
a caller behind on a fast stream handles its backlog at once (one SSE event for several tokens).
`release(endpoint)` (the worker left discovery) closes its connection once no stream uses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from dynamo_pd.runtime import rpc_wire as wire
from dynamo_pd.runtime.context import RequestContext
from dynamo_pd.runtime.inbox import Inbox
from dynamo_pd.runtime.security import RPC_MAX_BYTES, Security, current
from dynamo_pd.runtime.zmq_send import send_now
from dynamo_pd.runtime.errors import (
    FirstResponseTimeoutError,
    InvalidRequestError,
    PromptTooLongError,
    RemoteError,
    RequestCancelledError,
    StreamStalledError,
    WorkerDrainingError,
    WorkerGoneError,
)

log = logging.getLogger(__name__)

_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_END = object()
_CANCELLED = object()


class _Connection:
    """One DEALER to one worker; owns the queues of the streams open on it."""

    def __init__(self, endpoint: str, heartbeat_timeout_s: float, ping_s: float, security: Security):
        self.endpoint = endpoint
        self._ping_s = ping_s
        ctx = zmq.asyncio.Context.instance()
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.linger = 0
        self._sock.routing_id = uuid.uuid4().bytes
        self._sock.sndhwm = self._sock.rcvhwm = 100_000
        self._sock.heartbeat_ivl = max(100, int(heartbeat_timeout_s * 1000 / 3))
        self._sock.heartbeat_timeout = int(heartbeat_timeout_s * 1000)
        security.client(self._sock, RPC_MAX_BYTES)
        self._monitor = self._sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | _HANDSHAKE_FAILED)
        self.settled = asyncio.Event()  # connected, or failed
        self.gone: WorkerGoneError | None = None
        self.released = False  # the worker left discovery: close once the last stream ends
        self._streams: dict[int, Inbox] = {}
        self._ids = itertools.count(1)
        self._outbox: tuple[list[wire.ToServer], list[bytes]] = ([], [])  # sent together at the turn's end
        self._flush_handle: asyncio.Handle | None = None
        try:
            self._sock.connect(endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"bad worker endpoint {endpoint!r}: {exc}") from exc
        # drains what is queued without a future per message; the reader's awaited recv (asyncio's socket)
        # comes after every drain, and it checks the socket before it waits (ZMQ's edge-triggered FD)
        self._sync = zmq.Socket.shadow(self._sock.underlying)
        self._tasks = [asyncio.create_task(self._read(), name=f"rpc-read-{endpoint}"),
                       asyncio.create_task(self._watch_connection(), name=f"rpc-monitor-{endpoint}"),
                       asyncio.create_task(self._ping(), name=f"rpc-ping-{endpoint}")]

    def open(self, payload: bytes, context: RequestContext) -> tuple[int, Inbox]:
        if self.gone is not None:
            raise self.gone
        stream = next(self._ids)
        inbox = Inbox()
        self._streams[stream] = inbox
        self._send(wire.Open(stream, context.request_id, context.metadata), payload)
        return stream, inbox

    def close_stream(self, stream: int, cancel: bool) -> None:
        if self._streams.pop(stream, None) is not None and cancel and self.gone is None:
            self._send(wire.Cancel(stream))
        if self.released and not self._streams:
            self.fail(WorkerGoneError(f"connection to worker {self.endpoint} closed: it left discovery"))

    def release(self) -> None:
        self.released = True
        if not self._streams:
            self.fail(WorkerGoneError(f"connection to worker {self.endpoint} closed: it left discovery"))

    def _send(self, header: wire.ToServer, *payload: bytes) -> None:
        """Queue `header` (and an Open's payload), sent with the rest of this turn's messages to the worker;
        a send that fails fails the connection (every stream on it hears WorkerGoneError)."""
        headers, payloads = self._outbox
        headers.append(header)
        payloads += payload
        if self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_handle = None
        try:
            self._write()
        except zmq.ZMQError as exc:  # EAGAIN: 100k messages queued, the worker is not reading
            self.fail(WorkerGoneError(f"worker {self.endpoint} is not accepting messages: {exc}"))

    def _write(self) -> None:
        (headers, payloads), self._outbox = self._outbox, ([], [])
        if headers and self.gone is None:
            send_now(self._sock, [wire.encoder.encode(headers), *payloads])  # never waits: DEALER queues to the HWM

    async def _read(self) -> None:
        sync = self._sync
        while True:
            self._deliver(await self._sock.recv_multipart())
            while True:  # and whatever else is queued already
                try:
                    frames = sync.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._deliver(frames)

    def _deliver(self, frames: list[bytes]) -> None:
        try:
            headers = wire.client_decoder.decode(frames[0])
        except Exception as exc:
            log.warning("rpc client: dropping malformed message from %s: %s", self.endpoint, exc)
            return
        payloads = iter(frames[1:])
        for msg in headers:
            payload = next(payloads, b"") if isinstance(msg, wire.Data) else None
            inbox = self._streams.get(msg.stream)
            if inbox is None:
                continue  # a stream we already closed
            if payload is not None:
                inbox.put(payload)
            elif isinstance(msg, wire.End):
                inbox.put(_END)
            elif msg.client_error:  # rebuilt as the error it was, so no caller retries it
                error = PromptTooLongError if msg.error_type == PromptTooLongError.__name__ else InvalidRequestError
                inbox.put(error(msg.message, msg.param))
            elif msg.error_type == WorkerDrainingError.__name__:  # the worker is leaving: serve it elsewhere
                inbox.put(WorkerDrainingError(f"worker {self.endpoint}: {msg.message}"))
            else:
                inbox.put(RemoteError(msg.error_type, msg.message, self.endpoint))

    async def _watch_connection(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.settled.set()
            elif event & _HANDSHAKE_FAILED:
                self.fail(WorkerGoneError(f"worker {self.endpoint} refused the handshake "
                                          f"(not the same cluster secret?)"))
                return
            elif event == zmq.EVENT_DISCONNECTED:
                self.fail(WorkerGoneError(f"connection to worker {self.endpoint} dropped"))
                return
            elif event == zmq.EVENT_CONNECT_RETRIED and not self.settled.is_set():
                # refused: nothing listens there (workers register only once bound), so do not wait
                self.fail(WorkerGoneError(f"worker {self.endpoint} refused the connection"))
                return

    async def _ping(self) -> None:
        while True:
            await asyncio.sleep(self._ping_s)
            if self._streams and self.gone is None:
                self._send(wire.Ping())

    def fail(self, error: WorkerGoneError) -> None:
        """Mark the connection dead: every open stream gets `error`, and the sockets close."""
        if self.gone is not None:
            return
        if self._flush_handle is not None:  # what this turn queued goes first where it can (a Cancel before a close)
            self._flush_handle.cancel()
            self._flush_handle = None
            with contextlib.suppress(zmq.ZMQError):
                self._write()
        self.gone = error
        self.settled.set()
        for inbox in self._streams.values():
            inbox.put(WorkerGoneError(*error.args))  # one instance per stream: tracebacks stay apart
        self._streams.clear()
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        self._close_sockets()

    def _close_sockets(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._monitor.close()
        self._sock.close()  # the shadow shares its handle: nothing more to close


class RpcClient:
    def __init__(self, *, connect_timeout_s: float = 5.0, first_response_timeout_s: float = 60.0,
                 inter_response_timeout_s: float | None = None, heartbeat_timeout_s: float = 3.0,
                 ping_s: float = 1.0, security: Security | None = None):
        self.connect_timeout_s = connect_timeout_s
        self.first_response_timeout_s = first_response_timeout_s
        self.inter_response_timeout_s = inter_response_timeout_s
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._ping_s = ping_s
        self._security = security or current()
        self._connections: dict[str, _Connection] = {}

    @property
    def num_connections(self) -> int:
        return sum(conn.gone is None for conn in self._connections.values())

    def release(self, endpoint: str) -> None:
        """The worker at `endpoint` left discovery: close its connection once no stream uses it."""
        conn = self._connections.get(endpoint)
        if conn is not None:
            conn.release()
            self._forget_if_closed(conn)

    def _forget_if_closed(self, conn: _Connection) -> None:
        if conn.gone is not None and self._connections.get(conn.endpoint) is conn:
            del self._connections[conn.endpoint]

    async def _connection(self, endpoint: str) -> _Connection:
        conn = self._connections.get(endpoint)
        if conn is None or conn.gone is not None:
            conn = _Connection(endpoint, self._heartbeat_timeout_s, self._ping_s, self._security)
            self._connections[endpoint] = conn
        conn.released = False  # the worker is back before its streams ended: keep the connection
        if not conn.settled.is_set():
            try:
                async with asyncio.timeout(self.connect_timeout_s):
                    await conn.settled.wait()
            except asyncio.TimeoutError:
                conn.fail(WorkerGoneError(
                    f"could not connect to worker {endpoint} within {self.connect_timeout_s}s"))
        if conn.gone is not None:
            raise conn.gone
        return conn

    async def stream(self, endpoint: str, payload: bytes, context: RequestContext, *,
                     first_response_timeout_s: float | None = None) -> AsyncIterator[bytes]:
        """Yield the worker handler's chunks for `payload`; see the module docstring for the errors."""
        batches = self.stream_batches(endpoint, payload, context,
                                      first_response_timeout_s=first_response_timeout_s)
        async with contextlib.aclosing(batches):
            async for batch in batches:
                for chunk in batch:
                    yield chunk

    async def stream_batches(self, endpoint: str, payload: bytes, context: RequestContext, *,
                             first_response_timeout_s: float | None = None) -> AsyncIterator[list[bytes]]:
        """`stream`'s chunks, each time all those that had arrived (at least one)."""
        if context.cancelled:
            raise RequestCancelledError(f"request {context.request_id} was cancelled before it was sent")
        conn = await self._connection(endpoint)
        stream, inbox = conn.open(payload, context)

        forget_cancel = context.on_cancel(lambda: inbox.put(_CANCELLED))
        timeout, timeout_error = first_response_timeout_s or self.first_response_timeout_s, FirstResponseTimeoutError
        finished = False
        try:
            while True:
                if not await inbox.wait(timeout):
                    raise timeout_error(f"worker {endpoint} sent nothing for request {context.request_id} "
                                        f"within {timeout}s")
                timeout, timeout_error = self.inter_response_timeout_s, StreamStalledError
                items = inbox.take()
                n = 0
                while n < len(items) and type(items[n]) is bytes:
                    n += 1
                if n:  # the chunks first; an end or error after them waits for the next round
                    inbox.items[:0] = items[n:]
                    yield items if n == len(items) else items[:n]
                    continue
                item = items[0]
                if item is _END:
                    finished = True
                    return
                if item is _CANCELLED:
                    raise RequestCancelledError(f"request {context.request_id} was cancelled")
                finished = True  # an error: the worker's side is over already
                raise item
        finally:
            forget_cancel()
            conn.close_stream(stream, cancel=not finished)
            self._forget_if_closed(conn)

    async def close(self) -> None:
        for conn in self._connections.values():
            conn.fail(WorkerGoneError(f"rpc client closed (worker {conn.endpoint})"))
        self._connections.clear()
        await asyncio.sleep(0)  # let the cancelled tasks finish
