"""The embedded discovery server: leased keys and prefix watches over one ZMQ ROUTER socket.

The frontend or launcher hosts it in-process when no etcd address is given; workers reach it
with `connect_discovery(server.url)`. Semantics follow etcd's: a key lives under a lease, a
lease lives `ttl_s` after its last keep-alive, and a watch gets a snapshot then every change.

    server = DiscoveryServer()            # binds tcp://127.0.0.1:<random>
    await server.start(); server.url      # -> "tcp://127.0.0.1:41234"
    ...; await server.close()

Wire: the client's DEALER sends one msgpack `ClientMsg` per message; the server answers each
request with a `Reply` carrying the same `req`, and pushes `Change`s tagged with the watch's
`req`. Watches of a client silent for WATCH_IDLE_S are dropped. Lease ids are random so a
restarted server never renews a stranger's lease by accident.
Its own ROUTER loop, not rpc_server's: these are small idempotent requests a client resends, answered
at once, plus changes the server pushes unasked; a gone peer's messages are simply dropped. The RPC
server's streams, cancellation and unreachable-client errors would be dead weight here.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Literal

import msgspec
import zmq
import zmq.asyncio

from dynamo_pd.runtime.security import DISCOVERY_MAX_BYTES, Security, current
from dynamo_pd.runtime.tasks import cancel_and_wait
from dynamo_pd.runtime.zmq_send import send_now

log = logging.getLogger(__name__)

# A client with open watches pings every keep-alive interval; one silent this long is gone.
WATCH_IDLE_S = 15.0


class Grant(msgspec.Struct, tag=True):
    req: int
    ttl_s: float


class KeepAlive(msgspec.Struct, tag=True):
    req: int
    lease: int


class Revoke(msgspec.Struct, tag=True):
    req: int
    lease: int


class Put(msgspec.Struct, tag=True):
    req: int
    key: str
    value: bytes
    lease: int


class GetPrefix(msgspec.Struct, tag=True):
    req: int
    prefix: str


class Watch(msgspec.Struct, tag=True):
    req: int  # also the watch's id for its Changes
    prefix: str


class Unwatch(msgspec.Struct, tag=True):
    req: int  # the Watch's req; no reply


class Ping(msgspec.Struct, tag=True):
    req: int
    watches: list[int]  # the client's open watches; the reply names those the server lacks


ClientMsg = Grant | KeepAlive | Revoke | Put | GetPrefix | Watch | Unwatch | Ping


class Reply(msgspec.Struct, tag=True):
    req: int
    error: str = ""
    lease: int = 0
    items: dict[str, bytes] = {}
    missing: list[int] = []


class Change(msgspec.Struct, tag=True):
    req: int
    kind: Literal["put", "delete"]
    key: str
    value: bytes = b""


ServerMsg = Reply | Change


@dataclass
class _Lease:
    ttl_s: float
    deadline: float
    keys: set[str] = field(default_factory=set)


class DiscoveryServer:
    def __init__(self, endpoint: str = "tcp://127.0.0.1:0", expiry_check_s: float = 0.1, *,
                 security: Security | None = None):
        self._endpoint = endpoint
        self._security = security or current()
        self._expiry_check_s = expiry_check_s
        self._kv: dict[str, tuple[bytes, int]] = {}  # key -> (value, lease id)
        self._leases: dict[int, _Lease] = {}
        self._watches: dict[tuple[bytes, int], str] = {}  # (peer, watch id) -> prefix
        self._last_seen: dict[bytes, float] = {}  # peer -> when it last sent anything
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ClientMsg)
        self.url = ""

    async def start(self) -> str:
        if self._sock is not None:
            raise RuntimeError(f"discovery server already started at {self.url}")
        sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        sock.linger = 0
        sock.sndhwm = sock.rcvhwm = 100_000
        self._security.server(sock, DISCOVERY_MAX_BYTES)
        try:
            sock.bind(self._endpoint)
        except zmq.ZMQError as exc:
            sock.close()
            raise OSError(f"discovery server cannot bind {self._endpoint!r}: {exc}") from exc
        self._sock = sock
        self.url = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._tasks = [asyncio.create_task(self._serve(), name="discovery-serve"),
                       asyncio.create_task(self._expire(), name="discovery-expire")]
        log.info("discovery server listening on %s", self.url)
        return self.url

    async def close(self) -> None:
        await cancel_and_wait(self._tasks)
        self._tasks = []
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def __aenter__(self) -> DiscoveryServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def _serve(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 2:
                continue
            peer, body = frames
            self._last_seen[peer] = time.monotonic()
            try:
                msg = self._decoder.decode(body)
            except msgspec.DecodeError as exc:
                log.warning("discovery server: dropping undecodable message: %s", exc)
                continue
            try:
                reply = self._handle(peer, msg)
            except Exception as exc:  # a bad request must not take the server down
                log.exception("discovery server: %s failed", type(msg).__name__)
                reply = Reply(msg.req, error=f"{type(exc).__name__}: {exc}")
            if reply is not None:
                self._send(peer, reply)

    def _handle(self, peer: bytes, msg: ClientMsg) -> Reply | None:
        now = time.monotonic()
        if isinstance(msg, Grant):
            if not msg.ttl_s > 0:
                return Reply(msg.req, error=f"ttl_s must be > 0, got {msg.ttl_s}")
            lease_id = secrets.randbits(62) + 1
            self._leases[lease_id] = _Lease(msg.ttl_s, now + msg.ttl_s)
            return Reply(msg.req, lease=lease_id)
        if isinstance(msg, KeepAlive):
            lease = self._leases.get(msg.lease)
            if lease is None:
                return Reply(msg.req, error=f"lease {msg.lease} not found")
            lease.deadline = now + lease.ttl_s
            return Reply(msg.req)
        if isinstance(msg, Revoke):
            self._drop_lease(msg.lease)
            return Reply(msg.req)
        if isinstance(msg, Put):
            lease = self._leases.get(msg.lease)
            if lease is None:
                return Reply(msg.req, error=f"lease {msg.lease} not found")
            old = self._kv.get(msg.key)
            if old is not None and old[1] != msg.lease and old[1] in self._leases:
                self._leases[old[1]].keys.discard(msg.key)
            self._kv[msg.key] = (msg.value, msg.lease)
            lease.keys.add(msg.key)
            self._notify(Change(0, "put", msg.key, msg.value))
            return Reply(msg.req)
        if isinstance(msg, GetPrefix):
            return Reply(msg.req, items=self._items(msg.prefix))
        if isinstance(msg, Watch):
            self._watches[(peer, msg.req)] = msg.prefix
            return Reply(msg.req, items=self._items(msg.prefix))
        if isinstance(msg, Unwatch):
            self._watches.pop((peer, msg.req), None)
            return None
        return Reply(msg.req, missing=[w for w in msg.watches if (peer, w) not in self._watches])

    def _items(self, prefix: str) -> dict[str, bytes]:
        return {key: value for key, (value, _) in self._kv.items() if key.startswith(prefix)}

    def _drop_lease(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return
        for key in lease.keys:
            if self._kv.get(key, (b"", 0))[1] == lease_id:
                del self._kv[key]
                self._notify(Change(0, "delete", key))

    def _notify(self, change: Change) -> None:
        for (peer, watch_id), prefix in self._watches.items():
            if change.key.startswith(prefix):
                change.req = watch_id
                self._send(peer, change)

    def _send(self, peer: bytes, msg: Reply | Change) -> None:
        # A ROUTER send never blocks (it drops for a full or gone peer), so sending at once keeps order.
        send_now(self._sock, [peer, self._encoder.encode(msg)])

    async def _expire(self) -> None:
        while True:
            await asyncio.sleep(self._expiry_check_s)
            now = time.monotonic()
            for lease_id in [i for i, lease in self._leases.items() if lease.deadline < now]:
                log.info("discovery server: lease %d expired", lease_id)
                self._drop_lease(lease_id)
            for peer in [p for p, seen in self._last_seen.items() if now - seen > WATCH_IDLE_S]:
                del self._last_seen[peer]
                for watch in [w for w in self._watches if w[0] == peer]:
                    del self._watches[watch]
