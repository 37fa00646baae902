"""Service discovery with leases: a dead worker leaves the pool within about one TTL.

    discovery = await connect_discovery("tcp://127.0.0.1:7000")   # embedded server (see discovery_server)
    discovery = await connect_discovery("etcd://127.0.0.1:2379")  # etcd, through aetcd
    reg = await discovery.register(worker_info)   # keeps its lease alive in the background
    await discovery.list(WorkerInfo)              # -> list[WorkerInfo]
    async for kind, info in discovery.watch(WorkerInfo):  # snapshot as "added", then "added" / "removed"
        ...
    await reg.close()                             # revokes: the worker is "removed" at once
    await discovery.close()

A registration's lease lives `ttl_s` (default 3 s) and is renewed every `keepalive_s` (1 s); a
process that dies without revoking disappears when the lease runs out. If the lease is lost
anyway (the discovery server restarted, the process stalled past the TTL), the registration
grants a new one and puts its value again. "added" means added or changed: consumers upsert.
What a worker registers is its user's msgspec struct with a `worker_id` (dynamo_pd.protocol.WorkerInfo):
the runtime encodes it, and decodes it as the struct type the reader names.

Watches survive short outages: on reconnect the new snapshot is diffed against what the
watcher had seen, so removals during the outage still arrive as "removed". A backend that stays
unreachable for `reconnect_timeout_s` ends the watch with DiscoveryUnavailableError; a caller that
watches again passes what it holds as `seen`, and the new watch's snapshot is diffed against that
(dynamo_pd.frontend.membership does so for the worker pool).

Other planes share the mechanism through `advertise(key, value)` and `watch_prefix(prefix)`
(the ZMQ event plane advertises its publishers that way). Keys live under `namespace/`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Literal, NamedTuple, Protocol, TypeVar

import msgspec

from dynamo_pd.runtime.errors import DiscoveryUnavailableError
from dynamo_pd.runtime.security import Security, current

log = logging.getLogger(__name__)

WatchKind = Literal["added", "removed"]
WORKERS_PREFIX = "workers/"
Info = TypeVar("Info", bound=msgspec.Struct)  # what workers register, as its reader names it


class WorkerStruct(Protocol):
    """What `register` takes: a msgspec struct that names its worker."""

    worker_id: str


class Snapshot(NamedTuple):
    """First item of a store watch: every key under the prefix."""

    items: dict[str, bytes]


class Change(NamedTuple):
    kind: Literal["put", "delete"]
    key: str
    value: bytes  # b"" for deletes


class LeaseStore(Protocol):
    """What a backend provides; every call raises DiscoveryUnavailableError when it cannot answer in time."""

    async def grant(self, ttl_s: float) -> int: ...

    async def keep_alive(self, lease_id: int) -> bool:
        """False when the lease no longer exists."""

    async def revoke(self, lease_id: int) -> None: ...

    async def put(self, key: str, value: bytes, lease_id: int) -> None: ...

    async def get_prefix(self, prefix: str) -> dict[str, bytes]: ...

    def watch(self, prefix: str) -> AsyncIterator[Snapshot | Change]:
        """A Snapshot, then every Change after it, in order."""

    async def close(self) -> None: ...


class Registration:
    """One key kept alive under its own lease until `close()`."""

    def __init__(self, store: LeaseStore, key: str, value: bytes, ttl_s: float, keepalive_s: float):
        self.key = key
        self._store = store
        self._value = value
        self._ttl_s = ttl_s
        self._keepalive_s = keepalive_s
        self._lease_id = 0
        self._task: asyncio.Task | None = None
        self._on_close: Callable[[Registration], None] = lambda reg: None

    async def _start(self, patience_s: float) -> None:
        """Register, retrying for `patience_s`: a backend slow to answer (a loaded host) is no reason to die."""
        deadline = time.monotonic() + patience_s
        while True:
            try:
                await self._put_under_new_lease()
                break
            except DiscoveryUnavailableError as exc:
                if time.monotonic() >= deadline:
                    raise
                log.warning("registering %s failed, retrying: %s", self.key, exc)
        self._task = asyncio.create_task(self._keep_alive(), name=f"lease-{self.key}")

    async def _put_under_new_lease(self) -> None:
        lease_id = await self._store.grant(self._ttl_s)
        await self._store.put(self.key, self._value, lease_id)
        # Only now: if the put failed, the next keep-alive finds the old lease gone and retries.
        self._lease_id = lease_id

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(self._keepalive_s)
            try:
                if not await self._store.keep_alive(self._lease_id):
                    log.warning("lease for %s was lost; registering again", self.key)
                    await self._put_under_new_lease()
            except DiscoveryUnavailableError as exc:
                log.warning("keep-alive for %s failed, retrying: %s", self.key, exc)

    async def close(self) -> None:
        """Stop the keep-alive and revoke the lease (best effort: an unreachable backend lets it expire)."""
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        self._on_close(self)
        try:
            await self._store.revoke(self._lease_id)
        except DiscoveryUnavailableError as exc:
            log.warning("revoking %s failed; it expires with its lease: %s", self.key, exc)


class Discovery:
    def __init__(self, store: LeaseStore, *, namespace: str = "dynamo_pd", ttl_s: float = 3.0,
                 keepalive_s: float = 1.0, reconnect_timeout_s: float = 10.0):
        if not 0 < keepalive_s < ttl_s:
            raise ValueError(f"keepalive_s must be in (0, ttl_s={ttl_s}), got {keepalive_s}")
        if not namespace or "/" in namespace:
            raise ValueError(f"namespace must be a non-empty name without '/', got {namespace!r}")
        self._store = store
        self._root = namespace + "/"
        self.ttl_s = ttl_s
        self.keepalive_s = keepalive_s
        self.reconnect_timeout_s = reconnect_timeout_s
        self._registrations: set[Registration] = set()

    # Workers.

    async def register(self, info: WorkerStruct) -> Registration:
        if not info.worker_id or "/" in info.worker_id:
            raise ValueError(f"worker_id must be non-empty and without '/', got {info.worker_id!r}")
        return await self.advertise(WORKERS_PREFIX + info.worker_id, msgspec.msgpack.encode(info))

    async def list(self, struct: type[Info]) -> list[Info]:
        """Every registered worker, decoded as `struct`."""
        items = await self.get_prefix(WORKERS_PREFIX)
        return [info for key, value in sorted(items.items()) if (info := _decode_worker(key, value, struct))]

    async def watch(self, struct: type[Info], seen: Mapping[str, Info] | None = None
                    ) -> AsyncIterator[tuple[WatchKind, Info]]:
        """Workers decoded as `struct`. `seen`: the workers (by id) the caller already holds; the first
        snapshot is diffed against them."""
        known = {WORKERS_PREFIX + worker_id: msgspec.msgpack.encode(info) for worker_id, info in (seen or {}).items()}
        async with contextlib.aclosing(self.watch_prefix(WORKERS_PREFIX, known)) as changes:
            async for kind, key, value in changes:
                if info := _decode_worker(key, value, struct):
                    yield kind, info

    # Any leased key.

    async def advertise(self, key: str, value: bytes) -> Registration:
        reg = Registration(self._store, self._root + key, value, self.ttl_s, self.keepalive_s)
        await reg._start(self.reconnect_timeout_s)
        reg._on_close = self._registrations.discard
        self._registrations.add(reg)
        return reg

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        items = await self._store.get_prefix(self._root + prefix)
        return {key[len(self._root):]: value for key, value in items.items()}

    async def watch_prefix(self, prefix: str, seen: Mapping[str, bytes] | None = None
                           ) -> AsyncIterator[tuple[WatchKind, str, bytes]]:
        """(kind, key, value) for keys under `prefix`, keys without the namespace; resyncs after outages.
        `seen` (keys without the namespace): what the caller already holds, e.g. from a watch that ended."""
        seen = {self._root + key: value for key, value in (seen or {}).items()}
        lost_since: float | None = None
        while True:
            try:
                async with contextlib.aclosing(self._store.watch(self._root + prefix)) as items:
                    async for item in items:
                        lost_since = None
                        for kind, key, value in _apply(seen, item):
                            yield kind, key[len(self._root):], value
                raise DiscoveryUnavailableError("the watch stream ended")
            except DiscoveryUnavailableError as exc:
                now = time.monotonic()
                lost_since = lost_since or now
                if now - lost_since >= self.reconnect_timeout_s:
                    raise DiscoveryUnavailableError(
                        f"watch on {prefix!r} lost for {now - lost_since:.1f}s: {exc}") from exc
                log.warning("watch on %r interrupted, resyncing: %s", prefix, exc)
                await asyncio.sleep(self.keepalive_s)

    async def close(self) -> None:
        """Revoke every registration made through this object, then close the backend."""
        for reg in list(self._registrations):
            await reg.close()
        await self._store.close()

    async def __aenter__(self) -> Discovery:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()


def _apply(seen: dict[str, bytes], item: Snapshot | Change) -> list[tuple[WatchKind, str, bytes]]:
    """Fold a store item into `seen`; return the (kind, key, value) changes it makes visible."""
    if isinstance(item, Snapshot):
        gone = [key for key in seen if key not in item.items]
        out: list[tuple[WatchKind, str, bytes]] = [("removed", key, seen.pop(key)) for key in gone]
        for key, value in item.items.items():
            if seen.get(key) != value:
                seen[key] = value
                out.append(("added", key, value))
        return out
    if item.kind == "put":
        if seen.get(item.key) == item.value:
            return []
        seen[item.key] = item.value
        return [("added", item.key, item.value)]
    if item.key in seen:
        return [("removed", item.key, seen.pop(item.key))]
    return []


def _decode_worker(key: str, value: bytes, struct: type[Info]) -> Info | None:
    try:
        return msgspec.msgpack.decode(value, type=struct)
    except msgspec.DecodeError as exc:
        log.warning("skipping undecodable worker entry %s: %s", key, exc)
        return None


async def connect_discovery(url: str, *, namespace: str = "dynamo_pd", ttl_s: float = 3.0,
                            keepalive_s: float = 1.0, request_timeout_s: float = 5.0,
                            security: Security | None = None) -> Discovery:
    """`etcd://host:port` for etcd, `tcp://host:port` for an embedded DiscoveryServer; `security`
    (default: the process's) gives etcd's credentials or the embedded server's CURVE keys."""
    security = security or current()
    if url.startswith("etcd://"):
        from dynamo_pd.runtime.discovery_etcd import EtcdStore

        store: LeaseStore = await EtcdStore.connect(url, request_timeout_s=request_timeout_s, auth=security.etcd)
    elif url.startswith("tcp://"):
        from dynamo_pd.runtime.discovery_embedded import EmbeddedStore

        store = EmbeddedStore(url, request_timeout_s=request_timeout_s, ping_s=keepalive_s, security=security)
    else:
        raise ValueError(f"discovery url must start with etcd:// or tcp://, got {url!r}")
    return Discovery(store, namespace=namespace, ttl_s=ttl_s, keepalive_s=keepalive_s)
