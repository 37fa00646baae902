"""Router replicas share their placements so two routers do not pile onto one worker.

Every placement, prefill-done and finish a router makes is published as a LoadUpdate; the other
replicas apply it to their own LoadTracker under a key prefixed by the sender's router id. Workers'
LoadMetrics still correct everything (router.load), so a replica that dies leaves no lasting error;
a remote placement whose finish never arrives (lost on the way, or its replica died) expires after
`placement_ttl_s`, so they do not pile up.

The transport is the caller's: `send` takes each update (it must not block the router) and sends
`encode(updates)`, a list of them (dynamo_pd.frontend.replicas sends what a turn of its loop made as one
message on the event plane), and whatever receives the other replicas' messages hands them to `apply`.

    sync = ReplicaSync(router.load, "r1", send=lambda update: ...); router.attach_replica_sync(sync)
    sync.apply(data)   # for each message received
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Literal

import msgspec

from router.indexer import WorkerId
from router.load import LoadKey, LoadTracker
from router.worker import Role

log = logging.getLogger(__name__)


class LoadUpdate(msgspec.Struct, array_like=True, frozen=True):
    router_id: str
    kind: Literal["place", "prefill_done", "finish"]
    key: str  # "<role>:<request id>" of the sender's LoadKey
    worker_id: WorkerId = ""
    prefill_tokens: int = 0
    blocks: int = 0
    # "finish" of a request that streamed to its end: its TTFT and ITL as the frontend measured them from
    # the tokenized request on (migration.Journey.latencies; the planner's observed latencies); 0: not measured
    ttft_s: float = 0.0
    itl_s: float = 0.0  # the mean between its output tokens
    # "place": the prompt's block hashes where the worker shares them (router.load), so a replica counts a prefix
    # that requests of both hold on one worker once
    hashes: tuple[int, ...] = ()


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[LoadUpdate])


def encode(updates: list[LoadUpdate]) -> bytes:
    return _encoder.encode(updates)


def decode(data: bytes) -> list[LoadUpdate]:
    """Raises msgspec.DecodeError on anything but a list of updates."""
    return _decoder.decode(data)


class ReplicaSync:
    def __init__(self, tracker: LoadTracker, router_id: str, send: Callable[[LoadUpdate], None],
                 placement_ttl_s: float = 600.0) -> None:
        self.tracker = tracker
        self.router_id = router_id
        self.placement_ttl_s = placement_ttl_s  # longer than any request; workers' reports correct the rest
        self.applied = 0
        self.expired = 0  # remote placements dropped because their finish never came
        self._send = send
        self._remote: OrderedDict[LoadKey, float] = OrderedDict()  # remote placement key -> expiry, oldest first

    @property
    def has_peers(self) -> bool:
        """Whether another replica reads the updates (a transport that knows overrides it): none are made
        while none does."""
        return True

    def publish(
        self, kind: str, key: LoadKey, worker_id: WorkerId = "", prefill_tokens: int = 0, blocks: int = 0,
        ttft_s: float = 0.0, itl_s: float = 0.0, hashes: Sequence[int] = (),
    ) -> None:
        self.expire()  # a replica that died placed its last requests here: they go too, peers or not
        if not self.has_peers:
            return
        wire_key = f"{key.role.value}:{key.request_id}"
        self._send(LoadUpdate(self.router_id, kind, wire_key, worker_id, prefill_tokens, blocks, ttft_s, itl_s,
                              tuple(hashes)))

    def apply(self, data: bytes) -> None:
        try:
            updates = decode(data)
        except msgspec.MsgspecError as exc:
            log.warning("ignored a malformed load update (%d bytes): %s", len(data), exc)
            return
        if updates and updates[0].router_id == self.router_id:
            return  # our own: a message holds one router's updates
        self.expire()
        for update in updates:
            self._apply(update)

    def _apply(self, update: LoadUpdate) -> None:
        role, _, request_id = update.key.partition(":")
        try:
            key = LoadKey(request_id, Role(role), update.router_id)
        except ValueError as exc:
            log.warning("ignored a malformed load update: %s", exc)
            return
        if update.kind == "place":
            try:
                self.tracker.place(key, update.worker_id, update.prefill_tokens, update.blocks, update.hashes)
            except (KeyError, ValueError) as exc:  # a worker this replica has not discovered yet
                log.debug("load update from %s not applied: %s", update.router_id, exc)
                return
            self._remote[key] = time.monotonic() + self.placement_ttl_s
        elif update.kind == "prefill_done":
            self.tracker.prefill_done(key)
        else:
            self.tracker.finish(key)
            self._remote.pop(key, None)
        self.applied += 1

    def expire(self) -> None:
        """Drop remote placements older than placement_ttl_s (their finish was lost)."""
        now = time.monotonic()
        while self._remote and next(iter(self._remote.values())) < now:
            key, _ = self._remote.popitem(last=False)
            if self.tracker.finish(key):
                self.expired += 1
