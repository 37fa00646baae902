"""The frontend's worker set, reconciled against discovery for good.

    membership = Membership(discovery, joined=on_joined, left=on_left)
    task = asyncio.create_task(membership.run())      # until cancelled

`joined(info)` (awaited) runs once per registration seen, `left(info)` once when it goes. A worker
whose registration changes (restarted under the same id on new ports, or with another layout) is a
`left(old)` then a `joined(new)`, so its connections are dialled again. Discovery's watch resyncs
across short outages; one longer than its `reconnect_timeout_s` ends the watch, and the next one
starts from the workers held here, so those that left meanwhile still get their `left`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from dynamo_pd.protocol import WorkerInfo
from dynamo_pd.runtime import Discovery, DiscoveryUnavailableError

log = logging.getLogger("dynamo_pd.frontend")


class Membership:
    def __init__(self, discovery: Discovery, joined: Callable[[WorkerInfo], Awaitable[None]],
                 left: Callable[[WorkerInfo], None], retry_s: float = 1.0) -> None:
        self._discovery = discovery
        self._joined, self._left = joined, left
        self._retry_s = retry_s
        self.workers: dict[str, WorkerInfo] = {}  # every registered worker, served or refused
        self.outages = 0  # watches that ended and were started again

    async def run(self) -> None:
        while True:
            try:
                async for kind, info in self._discovery.watch(WorkerInfo, seen=self.workers):
                    await self._apply(kind, info)
            except DiscoveryUnavailableError as exc:
                self.outages += 1
                log.error("discovery unavailable (%s); watching again in %.1fs", exc, self._retry_s)
            await asyncio.sleep(self._retry_s)

    async def _apply(self, kind: str, info: WorkerInfo) -> None:
        old = self.workers.get(info.worker_id)
        if kind == "removed":
            if old is not None:
                del self.workers[info.worker_id]
                self._left(old)
            return
        if old == info:
            return
        if old is not None:
            log.info("worker %s registered again with changes; dialling it anew", info.worker_id)
            self._left(old)
        self.workers[info.worker_id] = info
        await self._joined(info)
