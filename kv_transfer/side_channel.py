"""The side channel: a ZMQ ROUTER per agent for control messages (Begin / Finish / NIXL metadata)
and, on the ZMQ transport, the KV bytes themselves.

Wire format (every message is multipart):
    client -> server  [call_id(8 bytes), msgpack(Request), *data frames]
    server -> client  [call_id, b"D", *data frames]   zero or more, ZMQ pull streams only
                      [call_id, b"R", msgpack(Reply)] exactly one, ends the call
Every wait is bounded: a call that sees no message for `timeout` seconds raises PeerLostError.
Every socket refuses message parts over `max_bytes` (zmq.MAXMSGSIZE: the sender's connection drops,
the server goes on; size it with `max_message_bytes`), and a `Guard` may secure it before it binds or
connects (dynamo_pd's runtime.security.Security: CURVE from the cluster secret). A server bound on a
wildcard address gives its `endpoint` with `advertise_host` in its place, the address peers reach.
The server answers each request in its own task, so a Begin or Finish never waits behind a bulk copy;
malformed messages are counted and dropped. A client keeps at most MAX_IDLE idle connections.
Not dynamo_pd.runtime's request plane: kv_transfer is a library below dynamo_pd (it imports nothing
from it), and this channel carries KV bytes: unbounded queues of zero-copy data frames, inproc://
endpoints between agents in one process, and a lost peer found by the call's timeout and the hand-off's lease.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec
import zmq
import zmq.asyncio

from kv_transfer.protocol import PeerLostError, Reply, Request

log = logging.getLogger(__name__)

DATA, REPLY = b"D", b"R"
MAX_IDLE = 64  # idle peer connections a client keeps; older idle ones close (peers come and go)
CONTROL_BYTES = 4 << 20  # room for a control message: NIXL metadata in a Reply, a descriptor in a Reserve
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_encoder = msgspec.msgpack.Encoder()

# (request, data frames, send(data frames) for streaming back) -> reply
Handler = Callable[[Request, list[zmq.Frame], Callable[[Sequence], Awaitable[None]]], Awaitable[Reply]]


class Guard(Protocol):
    """Sets a socket's inbound size limit and its security, before it binds (server) or connects (client)."""

    def server(self, sock: zmq.Socket, max_bytes: int) -> None: ...

    def client(self, sock: zmq.Socket, max_bytes: int) -> None: ...


class Plain:
    """No security: the size limit only."""

    def server(self, sock: zmq.Socket, max_bytes: int) -> None:
        sock.maxmsgsize = max_bytes

    client = server


def max_message_bytes(num_blocks: int, frame_bytes: int) -> int:
    """The largest message part a side channel carries: a bulk frame (block_frames cuts them at
    frame_bytes) or a control message, whose block id lists grow with the cache (<= 9 bytes an id)."""
    return max(frame_bytes, CONTROL_BYTES + 2 * 9 * num_blocks)


def _advertised(endpoint: str, host: str) -> str:
    if not host or not endpoint.startswith("tcp://"):
        return endpoint
    return f"tcp://{f'[{host}]' if ':' in host else host}:{endpoint.rpartition(':')[2]}"


def _context() -> zmq.asyncio.Context:
    # One context per process so inproc:// endpoints of agents in one process reach each other.
    return zmq.asyncio.Context.instance()


class SideChannelServer:
    def __init__(self, endpoint: str, handler: Handler, *, max_bytes: int = CONTROL_BYTES, guard: Guard = Plain(),
                 advertise_host: str = ""):
        self._socket = _context().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # raise instead of dropping replies
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        guard.server(self._socket, max_bytes)
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as e:
            self._socket.close(linger=0)
            raise OSError(f"KV side channel cannot bind {endpoint!r}: {e}") from e
        self._bound = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.endpoint: str = _advertised(self._bound, advertise_host)
        self._handler = handler
        self._task: asyncio.Task | None = None
        self._answers: set[asyncio.Task] = set()
        self.malformed = 0  # messages dropped or refused as unreadable

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            message = await self._socket.recv_multipart(copy=False)
            if len(message) < 3:  # [identity, call id, body] at least: nothing to answer
                self.malformed += 1
                log.warning("side channel dropped a %d-frame message", len(message))
                continue
            task = asyncio.get_running_loop().create_task(self._answer(*message))
            self._answers.add(task)
            task.add_done_callback(self._answers.discard)

    async def _answer(self, identity: zmq.Frame, call_id: zmq.Frame, body: zmq.Frame, *frames: zmq.Frame) -> None:
        peer = [identity.bytes, call_id.bytes]
        try:
            request = _request_decoder.decode(body.buffer)
        except msgspec.DecodeError as e:
            self.malformed += 1
            reply = Reply(False, "bad_request", f"undecodable request: {e}")
        else:
            async def send_data(data: Sequence) -> None:
                await self._socket.send_multipart([*peer, DATA, *data], copy=False)
            try:
                reply = await self._handler(request, list(frames), send_data)
            except Exception as e:  # a bad request must not kill the server
                log.exception("side channel handler failed on %r", type(request).__name__)
                reply = Reply(False, "bad_request", f"{type(e).__name__}: {e}")
        try:
            await self._socket.send_multipart([*peer, REPLY, _encoder.encode(reply)])
        except zmq.ZMQError as e:  # the client went away; its lease handles the rest
            log.warning("side channel reply not delivered: %s", e)

    async def close(self) -> None:
        tasks = [t for t in (self._task, *self._answers) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # close() releases the endpoint later, in ZMQ's reaper thread; unbind() releases it now, so
        # an agent started right after this one under the same inproc name can bind it.
        try:
            self._socket.unbind(self._bound)
        except zmq.ZMQError:
            pass
        self._socket.close(linger=0)


@dataclass(eq=False)
class _Connection:
    socket: zmq.asyncio.Socket
    reader: asyncio.Task
    calls: int = 0  # calls in flight on it
    retired: bool = False  # forgotten: closes when its last call ends

    def close(self) -> None:
        self.reader.cancel()
        self.socket.close(linger=0)


class SideChannelClient:
    """One DEALER per peer endpoint, replies routed to calls by call id."""

    def __init__(self, *, max_bytes: int = CONTROL_BYTES, guard: Guard = Plain()) -> None:
        self._max_bytes, self._guard = max_bytes, guard
        self._connections: OrderedDict[str, _Connection] = OrderedDict()  # least recently used first
        self._calls: dict[bytes, asyncio.Queue] = {}
        self._ids = itertools.count(1)
        self._retired: set[_Connection] = set()  # forgotten, closing once their calls end
        self.malformed = 0  # replies dropped as unreadable

    def _connect(self, endpoint: str) -> _Connection:
        conn = self._connections.get(endpoint)
        if conn is None:
            sock = _context().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            self._guard.client(sock, self._max_bytes)
            sock.connect(endpoint)
            conn = self._connections[endpoint] = _Connection(
                sock, asyncio.get_running_loop().create_task(self._read(sock))
            )
            idle = [e for e, c in self._connections.items() if c.calls == 0 and c is not conn]
            for old in idle[: max(0, len(self._connections) - MAX_IDLE)]:
                self.forget(old)
        self._connections.move_to_end(endpoint)
        return conn

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            message = await sock.recv_multipart(copy=False)
            if len(message) < 2:
                self.malformed += 1
                log.warning("side channel client dropped a %d-frame reply", len(message))
                continue
            call_id, kind, *rest = message
            queue = self._calls.get(call_id.bytes)
            if queue is not None:  # else: a call that already timed out
                queue.put_nowait((kind.bytes, rest))

    async def call(
        self,
        endpoint: str,
        request: Request,
        timeout: float,
        frames: Sequence = (),
        on_data: Callable[[list[zmq.Frame]], None] | None = None,
    ) -> Reply:
        """Send `request` (plus data frames) and wait for the reply, feeding streamed data to on_data."""
        call_id = next(self._ids).to_bytes(8, "little")
        queue: asyncio.Queue = asyncio.Queue()
        self._calls[call_id] = queue
        conn = self._connect(endpoint)
        conn.calls += 1
        try:
            # A DEALER with no peer pipe (down, or a refused CURVE handshake) blocks on send. A POLLOUT
            # check first is not enough: the pipe can vanish between the poll and the send.
            try:
                async with asyncio.timeout(timeout):
                    await conn.socket.send_multipart([call_id, _encoder.encode(request), *frames], copy=False)
            except asyncio.TimeoutError:
                raise PeerLostError(
                    f"could not send {type(request).__name__} to {endpoint} within {timeout:.1f}s") from None
            while True:
                try:
                    async with asyncio.timeout(timeout):
                        kind, rest = await queue.get()
                except asyncio.TimeoutError:
                    raise PeerLostError(
                        f"no answer from {endpoint} to {type(request).__name__} within {timeout:.1f}s"
                    ) from None
                if kind == REPLY:
                    try:
                        return _reply_decoder.decode(rest[0].buffer)
                    except (IndexError, msgspec.DecodeError) as e:
                        self.malformed += 1
                        raise PeerLostError(f"{endpoint} answered {type(request).__name__} unreadably: {e}") from None
                if on_data is None:
                    raise PeerLostError(f"{endpoint} streamed data for a call that expects none")
                on_data(rest)
        finally:
            del self._calls[call_id]
            conn.calls -= 1
            if conn.retired and conn.calls == 0:
                self._retired.discard(conn)
                conn.close()

    def forget(self, endpoint: str) -> None:
        """Drop the connection to a peer that failed, so a restarted peer gets a clean one. Calls still
        in flight on it finish on it (one failed call fails only itself); it closes after the last."""
        conn = self._connections.pop(endpoint, None)
        if conn is None:
            return
        conn.retired = True
        if conn.calls == 0:
            conn.close()
        else:
            self._retired.add(conn)

    def connections(self) -> int:
        """Peer connections open now (idle ones beyond MAX_IDLE are closed as new peers come)."""
        return len(self._connections)

    async def close(self) -> None:
        conns = [*self._connections.values(), *self._retired]
        self._connections.clear()
        self._retired.clear()
        for conn in conns:  # calls still in flight on them time out (PeerLostError)
            conn.close()
        await asyncio.gather(*(c.reader for c in conns), return_exceptions=True)
