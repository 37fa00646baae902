"""The side channel: a ZMQ ROUTER per agent for control messages (Begin / Finish / NIXL metadata)
and, on the ZMQ transport, the KV bytes themselves.

Wire format (every message is multipart):
    client -> server  [call_id(8 bytes), msgpack(Request), *data frames]
    server -> client  [call_id, b"D", *data frames]   zero or more, ZMQ pull streams only
                      [call_id, b"R", msgpack(Reply)] exactly one, ends the call
Every wait is bounded: a call that sees no message for `timeout` seconds raises PeerLostError.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence

import msgspec
import zmq
import zmq.asyncio

from kv_transfer.protocol import PeerLostError, Reply, Request

log = logging.getLogger(__name__)

DATA, REPLY = b"D", b"R"
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_encoder = msgspec.msgpack.Encoder()

# (request, data frames, send(data frames) for streaming back) -> reply
Handler = Callable[[Request, list[zmq.Frame], Callable[[Sequence], Awaitable[None]]], Awaitable[Reply]]


def _context() -> zmq.asyncio.Context:
    # One context per process so inproc:// endpoints of agents in one process reach each other.
    return zmq.asyncio.Context.instance()


class SideChannelServer:
    def __init__(self, endpoint: str, handler: Handler):
        self._socket = _context().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # raise instead of dropping replies
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        self._socket.bind(endpoint.replace("127.0.0.1:0", "127.0.0.1:*"))
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._handler = handler
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            identity, call_id, body, *frames = await self._socket.recv_multipart(copy=False)
            peer = [identity.bytes, call_id.bytes]
            try:
                request = _request_decoder.decode(body.buffer)
            except msgspec.DecodeError as e:
                reply = Reply(False, "bad_request", f"undecodable request: {e}")
            else:
                async def send_data(data: Sequence, _peer=peer) -> None:
                    await self._socket.send_multipart([*_peer, DATA, *data], copy=False)
                try:
                    reply = await self._handler(request, frames, send_data)
                except Exception as e:  # a bad request must not kill the server
                    log.exception("side channel handler failed on %r", type(request).__name__)
                    reply = Reply(False, "bad_request", f"{type(e).__name__}: {e}")
            try:
                await self._socket.send_multipart([*peer, REPLY, _encoder.encode(reply)])
            except zmq.ZMQError as e:  # the client went away; its lease handles the rest
                log.warning("side channel reply not delivered: %s", e)

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        # close() releases the endpoint later, in ZMQ's reaper thread; unbind() releases it now, so
        # an agent started right after this one under the same inproc name can bind it.
        try:
            self._socket.unbind(self.endpoint)
        except zmq.ZMQError:
            pass
        self._socket.close(linger=0)


class SideChannelClient:
    """One DEALER per peer endpoint, replies routed to calls by call id."""

    def __init__(self) -> None:
        self._sockets: dict[str, zmq.asyncio.Socket] = {}
        self._readers: dict[str, asyncio.Task] = {}
        self._calls: dict[bytes, asyncio.Queue] = {}
        self._ids = itertools.count(1)

    def _socket(self, endpoint: str) -> zmq.asyncio.Socket:
        if endpoint not in self._sockets:
            sock = _context().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.connect(endpoint)
            self._sockets[endpoint] = sock
            self._readers[endpoint] = asyncio.get_running_loop().create_task(self._read(sock))
        return self._sockets[endpoint]

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            call_id, kind, *rest = await sock.recv_multipart(copy=False)
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
        try:
            await self._socket(endpoint).send_multipart([call_id, _encoder.encode(request), *frames], copy=False)
            while True:
                try:
                    kind, rest = await asyncio.wait_for(queue.get(), timeout)
                except asyncio.TimeoutError:
                    raise PeerLostError(
                        f"no answer from {endpoint} to {type(request).__name__} within {timeout:.1f}s"
                    ) from None
                if kind == REPLY:
                    return _reply_decoder.decode(rest[0].buffer)
                if on_data is None:
                    raise PeerLostError(f"{endpoint} streamed data for a call that expects none")
                on_data(rest)
        finally:
            del self._calls[call_id]

    def forget(self, endpoint: str) -> None:
        """Drop the connection to a peer that failed, so a restarted peer gets a clean one."""
        sock = self._sockets.pop(endpoint, None)
        task = self._readers.pop(endpoint, None)
        if task:
            task.cancel()
        if sock:
            sock.close(linger=0)

    async def close(self) -> None:
        tasks = list(self._readers.values())
        for endpoint in list(self._sockets):
            self.forget(endpoint)
        await asyncio.gather(*tasks, return_exceptions=True)
