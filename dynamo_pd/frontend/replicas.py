"""Frontends on one namespace share their routers' placements on the deployment's event plane.

Behind a load balancer, two frontends would each see only their own requests until the workers'
next load report, and could both pick the same idle worker. Each frontend's router publishes every
placement, prefill-done and finish (router.replica_sync.LoadUpdate) on `<namespace>.router.load`, those
of one turn of its loop as one message;
the others add it to their load under the sender's id. The workers' load reports still correct
every prediction, so an update lost on the way or a frontend that dies leaves no lasting error.
A subscription lost with the event plane is made again (frontend.resubscribe).
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from dynamo_pd.frontend.resubscribe import follow_subject
from dynamo_pd.runtime import EventPlane
from dynamo_pd.runtime.tasks import cancel_and_wait
from router.load import LoadTracker
from router.replica_sync import LoadUpdate, ReplicaSync, encode

log = logging.getLogger(__name__)


class EventPlaneReplicaSync(ReplicaSync):
    def __init__(self, tracker: LoadTracker, events: EventPlane, namespace: str) -> None:
        super().__init__(tracker, router_id=f"frontend-{uuid.uuid4().hex[:8]}", send=self._send_soon)
        self._events = events
        self.subject = f"{namespace}.router.load"
        self._tasks: set[asyncio.Task] = set()  # the follower and sends in flight, referenced until done
        self._outbox: list[LoadUpdate] = []
        self._sending = False

    async def start(self) -> None:
        subscription = await self._events.subscribe(self.subject)  # live before the first request
        follower = asyncio.create_task(
            follow_subject(self._events, self.subject, lambda _subject, payload: self.apply(payload), subscription),
            name=f"replica-sync-{self.router_id}")
        self._tasks.add(follower)

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)

    def _send_soon(self, update: LoadUpdate) -> None:
        """Publish without making the router wait: one task sends what a turn of the loop published as one
        message (a message per update cost more than the rest of the update); a failure is logged (workers'
        load reports correct it)."""
        self._outbox.append(update)
        if len(self._outbox) == 1 and not self._sending:
            task = asyncio.get_running_loop().create_task(self._send_all())
            self._tasks.add(task)
            task.add_done_callback(self._sent)

    async def _send_all(self) -> None:
        self._sending = True
        try:
            while self._outbox:
                batch, self._outbox = self._outbox, []
                await self._events.publish(self.subject, encode(batch))
        finally:
            self._sending = False
            self._outbox.clear()  # what a failed send left behind: the next update starts a new task

    def _sent(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("load updates of %s not shared with other replicas: %r", self.router_id, exc)
