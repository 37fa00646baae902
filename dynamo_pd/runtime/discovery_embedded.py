"""Client of the embedded DiscoveryServer: the `LeaseStore` behind `connect_discovery("tcp://...")`.

One DEALER socket multiplexes requests (matched to replies by `req`) and watches. While watches
are open the client pings every `ping_s`, naming them; a watch the server no longer holds (it
restarted) or a ping left unanswered ends that watch with DiscoveryUnavailableError, which
`Discovery.watch_prefix` turns into a resync. Requests are resent within their timeout, so one
lost as the connection drops costs a fraction of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator

import msgspec
import zmq
import zmq.asyncio

from dynamo_pd.runtime import discovery_server as wire
from dynamo_pd.runtime.discovery import Change, Snapshot
from dynamo_pd.runtime.errors import DiscoveryUnavailableError
from dynamo_pd.runtime.security import DISCOVERY_MAX_BYTES, Security, current
from dynamo_pd.runtime.tasks import cancel_and_wait
from dynamo_pd.runtime.zmq_send import send_now

log = logging.getLogger(__name__)

_SENDS = 4  # how many times a request is sent within its timeout


class EmbeddedStore:
    def __init__(self, url: str, *, request_timeout_s: float = 5.0, ping_s: float = 1.0,
                 security: Security | None = None):
        self.url = url
        self._request_timeout_s = request_timeout_s
        self._ping_s = ping_s
        self._sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self._sock.linger = 0
        (security or current()).client(self._sock, DISCOVERY_MAX_BYTES)
        try:
            self._sock.connect(url)
        except zmq.ZMQError as exc:
            self._sock.close()
            raise ValueError(f"bad discovery url {url!r}: {exc}") from exc
        self._req = itertools.count(1)
        self._pending: dict[int, asyncio.Future[wire.Reply]] = {}
        self._watches: dict[int, asyncio.Queue] = {}
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(wire.ServerMsg)
        self._tasks = [asyncio.create_task(self._read(), name="discovery-client-read"),
                       asyncio.create_task(self._ping(), name="discovery-client-ping")]

    async def _call(self, msg: wire.ClientMsg) -> wire.Reply:
        """Send `msg` and await its reply, resending it a few times within the timeout: a message
        sent just as the connection dropped is lost, and every request is safe to repeat."""
        future = asyncio.get_running_loop().create_future()
        self._pending[msg.req] = future
        body = self._encoder.encode(msg)
        try:
            for _ in range(_SENDS):
                # never an awaited send: with no connected peer (down, or a refused CURVE handshake) a
                # DEALER's send blocks, and only the reply wait below is bounded
                with contextlib.suppress(zmq.Again):
                    send_now(self._sock, [body])
                done, _ = await asyncio.wait({future}, timeout=self._request_timeout_s / _SENDS)
                if done:
                    return future.result()
        finally:
            self._pending.pop(msg.req, None)
        raise DiscoveryUnavailableError(f"discovery server {self.url} did not answer {type(msg).__name__} "
                                        f"within {self._request_timeout_s}s")

    async def grant(self, ttl_s: float) -> int:
        reply = await self._call(wire.Grant(next(self._req), ttl_s))
        if reply.error:
            raise ValueError(reply.error)
        return reply.lease

    async def keep_alive(self, lease_id: int) -> bool:
        return not (await self._call(wire.KeepAlive(next(self._req), lease_id))).error

    async def revoke(self, lease_id: int) -> None:
        await self._call(wire.Revoke(next(self._req), lease_id))

    async def put(self, key: str, value: bytes, lease_id: int) -> None:
        reply = await self._call(wire.Put(next(self._req), key, value, lease_id))
        if reply.error:  # the lease expired between grant and put: the caller's keep-alive regrants
            raise DiscoveryUnavailableError(f"put {key!r} failed: {reply.error}")

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        return (await self._call(wire.GetPrefix(next(self._req), prefix))).items

    async def watch(self, prefix: str) -> AsyncIterator[Snapshot | Change]:
        watch_id = next(self._req)
        queue: asyncio.Queue = asyncio.Queue()
        self._watches[watch_id] = queue
        try:
            reply = await self._call(wire.Watch(watch_id, prefix))
            yield Snapshot(reply.items)
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                yield Change(item.kind, item.key, item.value)
        finally:
            self._watches.pop(watch_id, None)
            with contextlib.suppress(zmq.ZMQError):
                self._sock.send(self._encoder.encode(wire.Unwatch(watch_id)), flags=zmq.NOBLOCK)

    async def _read(self) -> None:
        while True:
            body = await self._sock.recv()
            try:
                msg = self._decoder.decode(body)
            except msgspec.DecodeError as exc:
                log.warning("discovery client: dropping undecodable message: %s", exc)
                continue
            if isinstance(msg, wire.Change):
                if (queue := self._watches.get(msg.req)) is not None:
                    queue.put_nowait(msg)
            elif (future := self._pending.get(msg.req)) is not None and not future.done():
                future.set_result(msg)

    async def _ping(self) -> None:
        while True:
            await asyncio.sleep(self._ping_s)
            if not self._watches:
                continue
            watch_ids = list(self._watches)
            try:
                lost = (await self._call(wire.Ping(next(self._req), watch_ids))).missing
                reason = "the discovery server no longer holds this watch (restarted?)"
            except DiscoveryUnavailableError as exc:
                lost, reason = watch_ids, str(exc)
            for watch_id in lost:
                if (queue := self._watches.get(watch_id)) is not None:
                    queue.put_nowait(DiscoveryUnavailableError(reason))

    async def close(self) -> None:
        await cancel_and_wait(self._tasks)
        self._sock.close()
