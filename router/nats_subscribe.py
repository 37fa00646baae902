"""NATS subscriptions that are live on the server when the call returns.

nats-py writes a flush's PING straight to the socket, ahead of a SUB still queued in its own
buffer, so `subscribe(); flush()` can return before the server has the subscription, and a
message another client publishes just then is lost. A probe published on a private inbox after
the SUBs travels behind them on the same connection: once it comes back, they are all live.
"""

from __future__ import annotations

import contextlib
from typing import Awaitable, Callable


async def subscribe_live(nc, subjects: list[str], cb: Callable[..., Awaitable[None]], timeout: float) -> list:
    """Subscribe `cb` to every subject; return the nats-py subscriptions once the server has them.

    Raises nats.errors.TimeoutError when the probe does not come back within `timeout` seconds;
    then no subscription is left behind.
    """
    import nats.errors  # optional extra: dynamo-pd[nats]

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
