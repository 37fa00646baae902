"""Frontends on one namespace share their routers' placements on the deployment's event plane.

Behind a load balancer, two frontends would each see only their own requests until the workers'
next load report, and could both pick the same idle worker. Each frontend's router publishes every
placement, prefill-done and finish (router.replica_sync.LoadUpdate) on `<namespace>.router.load`, those
of one turn of its loop as one message;
the others add it to their load under the sender's id. The workers' load reports still correct
every prediction, so an update lost on the way or a frontend that dies leaves no lasting error.
A subscription lost with the event plane is made again (frontend.resubscribe).

Each reader of the updates (a frontend, the planner: dynamo_pd.planner.observe) says it is there every
second on `<namespace>.router.load.hello.<its id>` (say_hello), and a frontend publishes its updates only
while it has heard another reader's hello within three seconds: a lone frontend (serve's default)
spent ~4% of its CPU on updates nobody read but itself. A reader that joins is sent updates from its
first hello on; what a frontend missed before, the workers' next load reports bring.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from dynamo_pd.frontend.resubscribe import follow_subject
from dynamo_pd.runtime import EventPlane
from dynamo_pd.runtime.tasks import cancel_and_wait
from router.load import LoadTracker
from router.replica_sync import LoadUpdate, ReplicaSync, encode

log = logging.getLogger(__name__)
HELLO_S = 1.0  # how often a reader says hello; one silent for three of them is gone


def hello_subject(namespace: str, reader_id: str) -> str:
    return f"{namespace}.router.load.hello.{reader_id}"


async def say_hello(events: EventPlane, subject: str, every_s: float = HELLO_S) -> None:
    """Publish on `subject` every `every_s` until cancelled (a failed send is tried again at the next)."""
    hello = encode([])  # an empty list of updates: a frontend of a version before hellos applies it as nothing
    while True:
        try:
            await events.publish(subject, hello)
        except Exception as exc:  # noqa: BLE001 - the plane is down: the next hello tries again
            log.debug("hello on %s not sent: %r", subject, exc)
        await asyncio.sleep(every_s)


class EventPlaneReplicaSync(ReplicaSync):
    def __init__(self, tracker: LoadTracker, events: EventPlane, namespace: str, hello_s: float = HELLO_S) -> None:
        super().__init__(tracker, router_id=f"frontend-{uuid.uuid4().hex[:8]}", send=self._send_soon)
        self._events = events
        self.subject = f"{namespace}.router.load"
        self._hello = hello_subject(namespace, self.router_id)
        self._hellos = hello_subject(namespace, "")  # how every reader's hello subject starts
        self._hello_s = hello_s
        self._peer_until = 0.0  # monotonic time until which another reader counts as there
        self._tasks: set[asyncio.Task] = set()  # the follower, the hellos and sends in flight, referenced until done
        self._outbox: list[LoadUpdate] = []
        self._sending = False

    @property
    def has_peers(self) -> bool:
        """Another reader said hello within the last 3 * HELLO_S (publish() sends nothing else)."""
        return time.monotonic() < self._peer_until

    async def start(self) -> None:
        subscription = await self._events.subscribe(self.subject)  # live before the first request
        follower = asyncio.create_task(
            follow_subject(self._events, self.subject, self._received, subscription),
            name=f"replica-sync-{self.router_id}")
        hellos = asyncio.create_task(say_hello(self._events, self._hello, self._hello_s),
                                     name=f"replica-hello-{self.router_id}")
        self._tasks.update((follower, hellos))

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)

    def _received(self, subject: str, payload: bytes) -> None:
        if not subject.startswith(self._hellos):
            self.apply(payload)
        elif subject != self._hello:
            self._peer_until = time.monotonic() + 3 * HELLO_S

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
