"""ZMQ event plane: every process publishes on its own PUB socket, advertised in discovery.

A plane binds one PUB socket (`host`, 127.0.0.1 by default, random port) and advertises its endpoint
(with `advertise_host` for a wildcard or another reachable address) under
`events/<id>` with a lease, so a dead publisher leaves discovery like a dead worker. A
subscription is one SUB socket that follows `events/`: it connects to every publisher there,
late joiners included, and disconnects from those that leave. No broker to host or lose.
Wire: [subject, payload] per message; ZMQ filters on the subject's bytes, the token boundary
("load" must not match "loadx") is checked on receipt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid

import zmq
import zmq.asyncio

from dynamo_pd.runtime.discovery import Discovery
from dynamo_pd.runtime.errors import DiscoveryUnavailableError, EventPlaneError
from dynamo_pd.runtime.events import EventPlane, Subscription, check_subject
from dynamo_pd.runtime.ports import advertised
from dynamo_pd.runtime.security import CONTROL_MAX_BYTES, EVENTS_MAX_BYTES, Security, current
from dynamo_pd.runtime.tasks import cancel_and_wait

log = logging.getLogger(__name__)

PUBLISHERS_PREFIX = "events/"


class ZmqEventPlane(EventPlane):
    def __init__(self, discovery: Discovery, pub: zmq.asyncio.Socket, advertise_host: str, security: Security):
        self._discovery = discovery
        self._pub = pub
        self._security = security
        self.endpoint = advertised(pub.getsockopt_string(zmq.LAST_ENDPOINT), advertise_host)
        self._registration = None
        self._subscriptions: set[Subscription] = set()

    @classmethod
    async def start(cls, discovery: Discovery, host: str = "127.0.0.1", advertise_host: str = "",
                    security: Security | None = None) -> ZmqEventPlane:
        security = security or current()
        pub = zmq.asyncio.Context.instance().socket(zmq.PUB)
        pub.linger = 0
        pub.sndhwm = 100_000
        security.server(pub, CONTROL_MAX_BYTES)  # a PUB receives only subscriptions
        try:
            pub.bind(f"tcp://{host}:0")
        except zmq.ZMQError as exc:
            pub.close()
            raise OSError(f"event plane cannot bind tcp://{host}:0: {exc}") from exc
        plane = cls(discovery, pub, advertise_host, security)
        try:
            plane._registration = await discovery.advertise(
                PUBLISHERS_PREFIX + uuid.uuid4().hex, plane.endpoint.encode())
        except BaseException:
            pub.close()
            raise
        return plane

    async def publish(self, subject: str, payload: bytes) -> None:
        # A PUB socket never blocks: past its high-water mark a slow subscriber loses messages.
        await self._pub.send_multipart([check_subject(subject).encode(), payload])

    async def subscribe(self, subject_prefix: str) -> Subscription:
        check_subject(subject_prefix, prefix=True)
        sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
        sock.linger = 0
        sock.rcvhwm = 100_000
        self._security.client(sock, EVENTS_MAX_BYTES)
        sock.subscribe(subject_prefix.encode())
        tasks: list[asyncio.Task] = []

        async def close() -> None:
            await cancel_and_wait(tasks)
            sock.close()
            self._subscriptions.discard(sub)

        sub = Subscription(subject_prefix, close)
        connected: set[str] = set()
        try:
            for endpoint in (await self._discovery.get_prefix(PUBLISHERS_PREFIX)).values():
                _connect(sock, connected, endpoint.decode())
        except BaseException:
            sock.close()
            raise
        tasks.append(asyncio.create_task(self._follow_publishers(sock, connected, sub), name="events-follow"))
        tasks.append(asyncio.create_task(_receive(sock, sub), name=f"events-recv-{subject_prefix}"))
        self._subscriptions.add(sub)
        return sub

    async def _follow_publishers(self, sock: zmq.asyncio.Socket, connected: set[str],
                                 sub: Subscription) -> None:
        try:
            async with contextlib.aclosing(self._discovery.watch_prefix(PUBLISHERS_PREFIX)) as changes:
                async for kind, _, value in changes:
                    endpoint = value.decode()
                    if kind == "added":
                        _connect(sock, connected, endpoint)
                    elif endpoint in connected:
                        connected.discard(endpoint)
                        with contextlib.suppress(zmq.ZMQError):
                            sock.disconnect(endpoint)
        except DiscoveryUnavailableError as exc:
            sub.fail(EventPlaneError(f"subscription to {sub.prefix!r} lost track of publishers: {exc}"))

    async def close(self) -> None:
        for sub in list(self._subscriptions):
            await sub.close()
        if self._registration is not None:
            await self._registration.close()
        self._pub.close()


def _connect(sock: zmq.asyncio.Socket, connected: set[str], endpoint: str) -> None:
    if endpoint in connected:
        return  # connecting twice would deliver every message twice
    try:
        sock.connect(endpoint)
        connected.add(endpoint)
    except zmq.ZMQError as exc:
        log.warning("event plane: cannot connect to publisher %r: %s", endpoint, exc)


async def _receive(sock: zmq.asyncio.Socket, sub: Subscription) -> None:
    while True:
        frames = await sock.recv_multipart()
        if len(frames) == 2:
            sub.deliver(frames[0].decode("utf-8", "replace"), frames[1])
