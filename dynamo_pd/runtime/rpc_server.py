"""Request plane, worker side: a streaming RPC server on one ZMQ ROUTER socket.

    async def handler(payload: bytes, context: RequestContext) -> AsyncIterator[bytes]:
        async for out in engine.generate(decode(payload), context):
            yield encode(out)

    server = RpcServer(handler)             # binds tcp://127.0.0.1:<random>
    await server.start(); server.endpoint   # advertise it in WorkerInfo.rpc_endpoint
    RpcServer(handler, "tcp://0.0.0.0:0", advertise_host="10.0.0.2")   # every interface; endpoint names 10.0.0.2
    await server.drain(timeout_s)           # refuse new streams, let open ones finish, end the rest
    ...; await server.close()               # cancels every open stream

Each stream runs the handler in its own task with a fresh RequestContext, holding the metadata the
call carried. A client's Cancel, a client silent for `client_timeout_s` (it pings every second while it
has streams) or a client that is gone sets the context and cancels the task, so the handler's `finally`
frees what it holds. A handler's `InvalidRequestError` reaches the client as itself (the client's fault); any
other exception as `RemoteError(type name, message)`. While draining, a new stream is refused and a
stream the drain timeout cuts short is ended, both with `WorkerDrainingError`: the caller serves the
request elsewhere (the frontend retries or migrates it).
The discovery server keeps its own ROUTER loop (see its docstring): the two share only a socket's
setup, while their protocols (streams with cancellation here; resent requests and pushed changes
there) and their handling of a gone peer differ.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

import msgspec
import zmq
import zmq.asyncio

from dynamo_pd.runtime import rpc_wire as wire
from dynamo_pd.runtime.context import RequestContext
from dynamo_pd.runtime.errors import InvalidRequestError, WorkerDrainingError
from dynamo_pd.runtime.ports import advertised
from dynamo_pd.runtime.security import RPC_MAX_BYTES, Security, current
from dynamo_pd.runtime.tasks import cancel_and_wait
from dynamo_pd.runtime.zmq_send import send_now

log = logging.getLogger(__name__)

Handler = Callable[[bytes, RequestContext], AsyncIterator[bytes]]


class RpcServer:
    def __init__(self, handler: Handler, endpoint: str = "tcp://127.0.0.1:0", client_timeout_s: float = 10.0, *,
                 advertise_host: str = "", security: Security | None = None):
        self._handler = handler
        self._bind_endpoint = endpoint
        self._advertise_host = advertise_host
        self._security = security or current()
        self._client_timeout_s = client_timeout_s
        self._sock: zmq.asyncio.Socket | None = None
        self._streams: dict[tuple[bytes, int], tuple[asyncio.Task, RequestContext]] = {}
        self._last_seen: dict[bytes, float] = {}
        # what this turn of the loop produced for each client, sent as one message at its end
        self._outbox: dict[bytes, tuple[list[wire.ToClient], list[bytes]]] = {}
        self._flush_handle: asyncio.Handle | None = None
        self._unreachable: set[bytes] = set()  # clients a send failed to, until they send again
        self._tasks: list[asyncio.Task] = []
        self._draining = False
        self.endpoint = ""

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    async def start(self) -> str:
        if self._sock is not None:
            raise RuntimeError(f"rpc server already started at {self.endpoint}")
        sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        sock.linger = 0
        sock.router_mandatory = 1  # a send to a gone client raises instead of vanishing
        sock.sndhwm = sock.rcvhwm = 100_000
        sock.heartbeat_ivl, sock.heartbeat_timeout = 1000, 5000  # drop half-open connections
        self._security.server(sock, RPC_MAX_BYTES)
        try:
            sock.bind(self._bind_endpoint)
        except zmq.ZMQError as exc:
            sock.close()
            raise OSError(f"rpc server cannot bind {self._bind_endpoint!r}: {exc}") from exc
        self._sock = sock
        self.endpoint = advertised(sock.getsockopt_string(zmq.LAST_ENDPOINT), self._advertise_host)
        self._tasks = [asyncio.create_task(self._serve(), name="rpc-serve"),
                       asyncio.create_task(self._reap(), name="rpc-reap")]
        return self.endpoint

    async def drain(self, timeout_s: float) -> int:
        """Refuse new streams; wait up to `timeout_s` for the open ones to end; end the rest with
        WorkerDrainingError (their handlers cancelled, so they free what they hold). Returns how many
        were cut short."""
        self._draining = True
        open_tasks = [task for task, _ in self._streams.values()]
        if open_tasks:
            await asyncio.wait(open_tasks, timeout=timeout_s)
        cut = list(self._streams.items())
        for key, (_task, context) in cut:
            self._cancel(key)
            self._send(key[0], context, wire.Fail(key[1], WorkerDrainingError.__name__,
                                                   f"the worker is shutting down; its drain timeout "
                                                   f"({timeout_s:g}s) ended request {context.request_id}"))
        return len(cut)

    async def close(self) -> None:
        tasks = self._tasks + [task for task, _ in self._streams.values()]
        for key in list(self._streams):
            self._cancel(key)
        await cancel_and_wait(tasks)
        self._tasks = []
        if self._sock is not None:
            if self._flush_handle is not None:
                self._flush_handle.cancel()
            self._flush()  # what drain() ended them with
            self._sock.close()
            self._sock = None

    async def __aenter__(self) -> RpcServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def _serve(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            peer = frames[0]
            self._last_seen[peer] = time.monotonic()
            self._unreachable.discard(peer)
            try:
                headers = wire.server_decoder.decode(frames[1])
            except (msgspec.DecodeError, IndexError) as exc:
                log.warning("rpc server: dropping malformed message from %r: %s", peer, exc)
                continue
            payloads = iter(frames[2:])
            for msg in headers:
                if isinstance(msg, wire.Open):
                    self._open(peer, msg, next(payloads, b""))
                elif isinstance(msg, wire.Cancel):
                    self._cancel((peer, msg.stream))

    def _open(self, peer: bytes, msg: wire.Open, payload: bytes) -> None:
        if self._draining:
            self._send(peer, RequestContext(msg.request_id), wire.Fail(
                msg.stream, WorkerDrainingError.__name__, "the worker is shutting down and takes no new requests"))
            return
        key = (peer, msg.stream)
        context = RequestContext(msg.request_id, msg.metadata)
        task = asyncio.create_task(self._run(key, payload, context), name=f"rpc-{msg.request_id}")
        self._streams[key] = (task, context)

    def _cancel(self, key: tuple[bytes, int]) -> None:
        entry = self._streams.pop(key, None)
        if entry is not None:
            task, context = entry
            context.cancel()  # set first, so the handler's cleanup sees why it stops
            task.cancel()

    async def _run(self, key: tuple[bytes, int], payload: bytes, context: RequestContext) -> None:
        peer, stream = key
        try:
            async with contextlib.aclosing(self._handler(payload, context)) as chunks:
                async for chunk in chunks:
                    if not self._send(peer, context, wire.Data(stream), chunk):
                        return  # leaving the block closes the handler, its context already cancelled
            self._send(peer, context, wire.End(stream))
        except asyncio.CancelledError:
            pass  # cancelled by the client, its absence, or close(): nobody waits for an answer
        except InvalidRequestError as exc:
            log.info("rpc stream %s refused: %s", context.request_id, exc)
            self._send(peer, context, wire.Fail(stream, type(exc).__name__, str(exc), True, exc.param))
        except Exception as exc:
            log.exception("rpc stream %s failed", context.request_id)
            self._send(peer, context, wire.Fail(stream, type(exc).__name__, str(exc)))
        finally:
            if self._streams.get(key, (None,))[0] is asyncio.current_task():
                del self._streams[key]

    def _send(self, peer: bytes, context: RequestContext, header: wire.ToClient, *payload: bytes) -> bool:
        """Queue `header` (and a Data's payload) for `peer`, sent with the rest of this turn's messages to
        it; False (and the context cancelled) when the client is gone."""
        if peer in self._unreachable:
            context.cancel()
            return False
        headers, payloads = self._outbox.setdefault(peer, ([], []))
        headers.append(header)
        payloads += payload
        if self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_soon(self._flush)
        return True

    def _flush(self) -> None:
        self._flush_handle = None
        outbox, self._outbox = self._outbox, {}
        if self._sock is None:
            return
        for peer, (headers, payloads) in outbox.items():
            try:
                send_now(self._sock, [peer, wire.encoder.encode(headers), *payloads])
            except zmq.ZMQError as exc:  # gone (EHOSTUNREACH), or 100k messages queued that it does not read
                keys = [key for key in self._streams if key[0] == peer]
                log.info("rpc client %s unreachable (%s); cancelling its %d streams", peer.hex()[:8], exc, len(keys))
                self._unreachable.add(peer)
                for key in keys:
                    self._cancel(key)

    async def _reap(self) -> None:
        """Cancel the streams of clients that stopped pinging (crashed, or their host went away)."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            silent = {peer for peer, seen in self._last_seen.items() if now - seen > self._client_timeout_s}
            for key in [k for k in self._streams if k[0] in silent]:
                log.warning("rpc stream %s: client silent for %.0fs; cancelling",
                            self._streams[key][1].request_id, self._client_timeout_s)
                self._cancel(key)
            for peer in silent:
                del self._last_seen[peer]
            self._unreachable -= silent
