"""A subscription that comes back: the frontend follows load reports and replica updates for good.

A ZMQ event-plane subscription ends when discovery stays away longer than its watch retries (it no
longer knows the publishers); NATS reconnects by itself, but a subscribe can still fail while it
is down. Either way the frontend subscribes again, every `retry_s`, until it is back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from dynamo_pd.runtime import EventPlane, Subscription
from dynamo_pd.runtime.errors import DiscoveryUnavailableError, EventPlaneError

log = logging.getLogger("dynamo_pd.frontend")


async def follow_subject(events: EventPlane, prefix: str, handle: Callable[[str, bytes], None],
                         subscription: Subscription | None = None, retry_s: float = 1.0) -> None:
    """Give every message on `prefix` to `handle` until cancelled or the plane closes; `subscription`:
    one already live on `prefix` to start with."""
    lost = False
    while True:
        try:
            if subscription is None:
                subscription = await events.subscribe(prefix)
            if lost:
                log.info("subscription to %r is back", prefix)
                lost = False
            async with subscription:
                async for subject, payload in subscription:
                    handle(subject, payload)
            return  # closed on purpose (the plane is closing)
        except (EventPlaneError, DiscoveryUnavailableError) as exc:
            if not lost:
                log.warning("subscription to %r lost (%s); subscribing again every %.1fs", prefix, exc, retry_s)
            lost, subscription = True, None
        await asyncio.sleep(retry_s)
