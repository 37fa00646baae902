"""NATS event plane (nats-py): subjects map one to one; a prefix subscription is `prefix` + `prefix.>`.

One connection per plane, and a process has one plane: its KV events, load reports and router-replica
updates all ride it. Subscriptions are live on the server when `subscribe` returns: nats-py writes a
flush's PING straight to the socket, ahead of a SUB still queued in its own buffer, so
`subscribe(); flush()` can return before the server has the subscription, and a message another
client publishes just then is lost. A probe published on a private inbox after the SUBs travels
behind them on the same connection: once it comes back, they are all live.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import nats
import nats.errors

from dynamo_pd.runtime.errors import EventPlaneError
from dynamo_pd.runtime.events import EventPlane, Subscription, check_subject
from dynamo_pd.runtime.security import NatsAuth

log = logging.getLogger(__name__)


async def subscribe_live(nc: nats.NATS, subjects: list[str], cb: Callable[..., Awaitable[None]],
                         timeout: float) -> list:
    """Subscribe `cb` to every subject; return the nats-py subscriptions once the server has them.

    Raises nats.errors.TimeoutError when the probe does not come back within `timeout` seconds;
    then no subscription is left behind.
    """
    inbox = nc.new_inbox()
    probe = await nc.subscribe(inbox)
    subs = []
    try:
        for subject in subjects:
            subs.append(await nc.subscribe(subject, cb=cb))
        await nc.publish(inbox, b"")
        await probe.next_msg(timeout=timeout)
    except BaseException:
        for sub in subs:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        raise
    finally:
        with contextlib.suppress(nats.errors.Error):
            await probe.unsubscribe()
    return subs


class NatsEventPlane(EventPlane):
    def __init__(self, client: nats.NATS, url: str, timeout_s: float):
        self._client = client
        self.url = url
        self._timeout_s = timeout_s
        self._subscriptions: set[Subscription] = set()

    @classmethod
    async def connect(cls, url: str, *, connect_timeout_s: float = 5.0, auth: NatsAuth = NatsAuth()) -> NatsEventPlane:
        failed: list[Exception] = []

        async def on_error(exc: Exception) -> None:  # nats-py retries a refused login: keep the cause to report
            # the server's refusal (nats.errors.Error), not a connection reset between two retries of it
            if not failed or isinstance(exc, nats.errors.Error) or not isinstance(failed[0], nats.errors.Error):
                failed[:] = [exc]
            log.warning("NATS %s: %r", url, exc)

        try:
            async with asyncio.timeout(connect_timeout_s * 2):
                client = await nats.connect(url, connect_timeout=connect_timeout_s, allow_reconnect=True,
                                            error_cb=on_error, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                                            **auth.connect_kwargs())
        except asyncio.TimeoutError as exc:
            cause = f": {failed[-1]!r}" if failed else ""
            raise EventPlaneError(f"cannot connect to NATS at {url} within {connect_timeout_s * 2}s{cause}") from exc
        except (OSError, nats.errors.Error) as exc:
            raise EventPlaneError(f"cannot connect to NATS at {url}: {exc!r}") from exc
        return cls(client, url, connect_timeout_s)

    async def publish(self, subject: str, payload: bytes) -> None:
        try:
            await self._client.publish(check_subject(subject), payload)
        except nats.errors.Error as exc:
            raise EventPlaneError(f"publish on {subject!r} to {self.url} failed: {exc!r}") from exc

    async def subscribe(self, subject_prefix: str) -> Subscription:
        check_subject(subject_prefix, prefix=True)
        subjects = [">"] if not subject_prefix else [subject_prefix, subject_prefix + ".>"]
        nats_subs = []

        async def on_message(msg) -> None:
            if not msg.subject.startswith("_INBOX."):  # NATS request plumbing (subscribe probes), not events
                sub.deliver(msg.subject, msg.data)

        async def close() -> None:
            for nats_sub in nats_subs:
                try:
                    await nats_sub.unsubscribe()
                except nats.errors.Error:
                    pass  # the connection is closing anyway
            self._subscriptions.discard(sub)

        sub = Subscription(subject_prefix, close)
        try:
            nats_subs.extend(await subscribe_live(self._client, subjects, on_message, self._timeout_s))
        except (asyncio.TimeoutError, nats.errors.Error) as exc:
            await close()
            raise EventPlaneError(f"subscribe to {subject_prefix!r} on {self.url} failed: {exc!r}") from exc
        self._subscriptions.add(sub)
        return sub

    async def close(self) -> None:
        for sub in list(self._subscriptions):
            await sub.close()
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._client.close()
        except (asyncio.TimeoutError, nats.errors.Error):
            pass
