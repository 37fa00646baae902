"""NATS event plane (nats-py): subjects map one to one; a prefix subscription is `prefix` + `prefix.>`."""

from __future__ import annotations

import asyncio

import nats
import nats.errors

from dynamo_pd.runtime.errors import EventPlaneError
from dynamo_pd.runtime.events import EventPlane, Subscription, check_subject
from router.nats_subscribe import subscribe_live


class NatsEventPlane(EventPlane):
    def __init__(self, client: nats.NATS, url: str, timeout_s: float):
        self._client = client
        self.url = url
        self._timeout_s = timeout_s
        self._subscriptions: set[Subscription] = set()

    @classmethod
    async def connect(cls, url: str, *, connect_timeout_s: float = 5.0) -> NatsEventPlane:
        try:
            client = await asyncio.wait_for(
                nats.connect(url, connect_timeout=connect_timeout_s, allow_reconnect=True,
                             max_reconnect_attempts=-1, reconnect_time_wait=0.5),
                connect_timeout_s * 2)
        except (asyncio.TimeoutError, OSError, nats.errors.Error) as exc:
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
            await asyncio.wait_for(self._client.close(), self._timeout_s)
        except (asyncio.TimeoutError, nats.errors.Error):
            pass
