"""Event plane: fire-and-forget publish / prefix subscribe, for load metrics and router state sharing.

    events = await connect_event_plane(None, discovery)            # ZMQ (default), see events_zmq
    events = await connect_event_plane("nats://127.0.0.1:4222")    # NATS, see events_nats
    await events.publish("load.worker-1", payload)
    async with await events.subscribe("load") as sub:              # "load" and "load.*.*...", not "loadx"
        async for subject, payload in sub:
            ...
    await events.close()

Subjects are dot-separated tokens of [A-Za-z0-9_-] (valid on both transports); a subscription to
a prefix gets the subject itself and everything below it, "" gets everything. Delivery is at most
once and starts shortly after `subscribe` returns (ZMQ: once its connections are up), so publish
state, not deltas. A subscriber that falls more than `max_pending` messages behind loses the
oldest ones (counted in `Subscription.dropped`).
"""

from __future__ import annotations

import abc
import asyncio
import re
from collections.abc import Awaitable, Callable

from dynamo_pd.runtime.discovery import Discovery
from dynamo_pd.runtime.security import Security, current

_SUBJECT = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")
_CLOSED = object()


def check_subject(subject: str, *, prefix: bool = False) -> str:
    if (prefix and subject == "") or _SUBJECT.fullmatch(subject):
        return subject
    raise ValueError(f"subject must be dot-separated tokens of [A-Za-z0-9_-], got {subject!r}")


def subject_matches(subject: str, prefix: str) -> bool:
    return not prefix or subject == prefix or subject.startswith(prefix + ".")


class Subscription:
    """Async iterator of (subject, payload); `close()` ends it."""

    def __init__(self, prefix: str, on_close: Callable[[], Awaitable[None]], max_pending: int = 10_000):
        self.prefix = check_subject(prefix, prefix=True)
        self.dropped = 0
        self._on_close = on_close
        self._queue: asyncio.Queue = asyncio.Queue(max_pending)
        self._closed = False

    def deliver(self, subject: str, payload: bytes) -> None:
        if self._closed or not subject_matches(subject, self.prefix):
            return
        if self._queue.full():
            self._queue.get_nowait()
            self.dropped += 1
        self._queue.put_nowait((subject, payload))

    def fail(self, error: Exception) -> None:
        """End the iteration with `error` (the transport behind the subscription broke)."""
        if not self._closed:
            while not self._queue.empty():
                self._queue.get_nowait()
            self._queue.put_nowait(error)

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> tuple[str, bytes]:
        item = await self._queue.get()
        if item is _CLOSED or isinstance(item, Exception):
            self._queue.put_nowait(item)  # later calls end the same way
            if item is _CLOSED:
                raise StopAsyncIteration
            raise item
        return item

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._on_close()
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(_CLOSED)

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()


class EventPlane(abc.ABC):
    @abc.abstractmethod
    async def publish(self, subject: str, payload: bytes) -> None: ...

    @abc.abstractmethod
    async def subscribe(self, subject_prefix: str) -> Subscription: ...

    @abc.abstractmethod
    async def close(self) -> None:
        """Close the plane and every subscription made through it."""


async def connect_event_plane(url: str | None = None, discovery: Discovery | None = None, *,
                              host: str = "127.0.0.1", advertise_host: str = "", connect_timeout_s: float = 5.0,
                              security: Security | None = None) -> EventPlane:
    """None or "zmq": ZMQ publishers (bound on `host`, advertised as `advertise_host`) found through
    `discovery`; "nats://host:port": NATS. `security` (default: the process's): CURVE keys or NATS credentials."""
    security = security or current()
    if url is None or url == "zmq":
        if discovery is None:
            raise ValueError("the ZMQ event plane finds publishers through discovery: pass `discovery`")
        from dynamo_pd.runtime.events_zmq import ZmqEventPlane

        return await ZmqEventPlane.start(discovery, host, advertise_host, security)
    if url.startswith("nats://") or url.startswith("tls://"):
        from dynamo_pd.runtime.events_nats import NatsEventPlane

        return await NatsEventPlane.connect(url, connect_timeout_s=connect_timeout_s, auth=security.nats)
    raise ValueError(f"event plane url must be None, 'zmq', nats://host:port or tls://host:port, got {url!r}")

