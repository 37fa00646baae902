"""Frontends on one namespace share their routers' placements on the deployment's event plane.

Behind a load balancer, two frontends would each see only their own requests until the workers'
next load report, and could both pick the same idle worker. Each frontend's router publishes every
placement, prefill-done and finish (router.replica_sync.LoadUpdate) on `<namespace>.router.load`;
the others add it to their load under the sender's id. The workers' load reports still correct
every prediction, so an update lost on the way or a frontend that dies leaves no lasting error.
"""

from __future__ import annotations

import asyncio
import uuid

from dynamo_pd.runtime import EventPlane
from router.load import LoadTracker
from router.replica_sync import ReplicaSync


class EventPlaneReplicaSync(ReplicaSync):
    def __init__(self, tracker: LoadTracker, events: EventPlane, namespace: str) -> None:
        super().__init__(tracker, router_id=f"frontend-{uuid.uuid4().hex[:8]}")
        self._events = events
        self.subject = f"{namespace}.router.load"

    async def start(self) -> None:
        subscription = await self._events.subscribe(self.subject)
        self._task = asyncio.create_task(self._follow(subscription), name=f"replica-sync-{self.router_id}")

    async def _follow(self, subscription) -> None:
        async with subscription:
            async for _subject, payload in subscription:
                self.apply(payload)

    def _send(self, data: bytes) -> None:
        self._send_soon(self._events.publish(self.subject, data))
