"""etcd as the `LeaseStore` behind `connect_discovery("etcd://host:port")`, through aetcd.

etcd leases have whole-second TTLs (rounded up here; etcd's own minimum is about 2 s) and etcd
checks expiry about twice a second, so a dead worker's keys go within TTL + ~0.5 s. A watch reads
the prefix, then watches from the revision after that read, so no change falls in between.

Credentials (security.EtcdAuth): user + password go to aetcd, which authenticates on connect and
sends the token with every call; TLS (a CA, a client certificate) needs a secure gRPC channel,
which aetcd 1.0 cannot open, so `_TlsClient` opens one in its place.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar
from urllib.parse import urlsplit

import aetcd
import aetcd.exceptions
import aetcd.utils
import grpc

from dynamo_pd.runtime.discovery import Change, Snapshot
from dynamo_pd.runtime.errors import DiscoveryUnavailableError
from dynamo_pd.runtime.security import EtcdAuth, Tls

T = TypeVar("T")


class EtcdStore:
    def __init__(self, client: aetcd.Client, url: str, request_timeout_s: float):
        self._client = client
        self.url = url
        self._timeout_s = request_timeout_s

    @classmethod
    async def connect(cls, url: str, *, request_timeout_s: float = 5.0, auth: EtcdAuth = EtcdAuth()) -> EtcdStore:
        parts = urlsplit(url)
        if parts.scheme != "etcd" or not parts.hostname:
            raise ValueError(f"etcd url must look like etcd://host:port, got {url!r}")
        if bool(auth.user) != bool(auth.password):
            raise ValueError("etcd credentials need both a user and a password")
        kwargs = dict(host=parts.hostname, port=parts.port or 2379, username=auth.user or None,
                      password=auth.password or None)
        client = _TlsClient(auth.tls, **kwargs) if auth.tls.enabled else aetcd.Client(**kwargs)
        store = cls(client, url, request_timeout_s)
        await store._call(client.connect(), "connect")
        await store._call(client.status(), "status")  # fail now, not on first use, if nobody answers
        return store

    async def _call(self, call: Awaitable[T], what: str) -> T:
        try:
            async with asyncio.timeout(self._timeout_s):
                return await call
        except asyncio.TimeoutError:
            raise DiscoveryUnavailableError(
                f"etcd {self.url} did not answer {what} within {self._timeout_s}s") from None
        except (aetcd.exceptions.ClientError, grpc.aio.AioRpcError) as exc:  # the latter: _TlsClient.connect
            raise DiscoveryUnavailableError(f"etcd {self.url} {what} failed: {exc!r}") from exc

    async def grant(self, ttl_s: float) -> int:
        lease = await self._call(self._client.lease(max(1, math.ceil(ttl_s))), "lease grant")
        return lease.id

    async def keep_alive(self, lease_id: int) -> bool:
        reply = await self._call(self._client.refresh_lease(lease_id), "lease keep-alive")
        return reply is not None and reply.TTL > 0

    async def revoke(self, lease_id: int) -> None:
        try:
            await self._call(self._client.revoke_lease(lease_id), "lease revoke")
        except DiscoveryUnavailableError as exc:
            if "not found" not in str(exc):  # already expired: nothing to revoke
                raise

    async def put(self, key: str, value: bytes, lease_id: int) -> None:
        await self._call(self._client.put(key.encode(), value, lease=lease_id), f"put {key!r}")

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        return (await self._get_prefix(prefix))[0]

    async def _get_prefix(self, prefix: str) -> tuple[dict[str, bytes], int]:
        result = await self._call(self._client.get_prefix(prefix.encode()), f"get {prefix!r}")
        return {kv.key.decode(): kv.value for kv in result}, result.header.revision

    async def watch(self, prefix: str) -> AsyncIterator[Snapshot | Change]:
        items, revision = await self._get_prefix(prefix)
        watch = await self._call(self._client.watch_prefix(prefix.encode(), start_revision=revision + 1),
                                 f"watch {prefix!r}")
        try:
            yield Snapshot(items)
            try:
                async for event in watch:
                    kind = "put" if event.kind == aetcd.rtypes.EventKind.PUT else "delete"
                    yield Change(kind, event.kv.key.decode(), event.kv.value if kind == "put" else b"")
            except aetcd.exceptions.ClientError as exc:
                raise DiscoveryUnavailableError(
                    f"etcd {self.url} watch on {prefix!r} failed: {exc!r}") from exc
        finally:
            try:
                async with asyncio.timeout(self._timeout_s):
                    await watch.cancel()
            except (asyncio.TimeoutError, aetcd.exceptions.ClientError):
                pass  # the stream is gone anyway

    async def close(self) -> None:
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._client.close()
        except (asyncio.TimeoutError, aetcd.exceptions.ClientError):
            pass


class _TlsClient(aetcd.Client):
    """aetcd's client on a TLS channel: aetcd.Client.connect with `secure_channel` for `insecure_channel`."""

    def __init__(self, tls: Tls, **kwargs):
        super().__init__(**kwargs)
        self._tls = tls

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        tls = self._tls
        read = lambda path: open(path, "rb").read() if path else None  # noqa: E731
        credentials = grpc.ssl_channel_credentials(read(tls.ca), read(tls.key), read(tls.cert))
        self.channel = aetcd.rpc.secure_channel(f"{self._host}:{self._port}", credentials,
                                                options=self._options.items())
        if self._username:
            response = await aetcd.rpc.AuthStub(self.channel).Authenticate(
                aetcd.rpc.AuthenticateRequest(name=self._username, password=self._password), timeout=self._timeout)
            self.metadata = (("token", response.token),)
        self.kvstub = aetcd.rpc.KVStub(self.channel)
        self.clusterstub = aetcd.rpc.ClusterStub(self.channel)
        self.leasestub = aetcd.rpc.LeaseStub(self.channel)
        self.maintenancestub = aetcd.rpc.MaintenanceStub(self.channel)
        self._watcher = aetcd.watcher.Watcher(aetcd.rpc.WatchStub(self.channel), timeout=self._timeout,
                                              metadata=self.metadata)
        self._connected.set()
