"""NIXL transport: one-sided UCX reads and writes straight between the two caches (DRAM or VRAM).

Each agent registers its whole cache once. A peer's NIXL metadata is fetched once per peer agent,
over the side channel or from etcd (`metadata_store="etcd://host:port"`, key
/dynamo_pd/kv_transfer/nixl/<agent>), and loaded with add_remote_agent. A transfer is one
initialize_xfer over the coalesced regions (one descriptor per run of consecutive blocks per
layer/K/V), polled with growing sleeps on the event loop (check_xfer_state never blocks) until
done, failed or `timeout` runs out. Scattered small regions are read packed: the holder gathers
them into one registered buffer on request (Pack) and the reader issues a single descriptor.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from urllib.parse import urlparse

import numpy as np
import torch

from kv_transfer.memory import STAGING, KVMemory
from kv_transfer.plan import TransferPlan
from kv_transfer.protocol import GetMetadata, Pack, PeerLostError, TransferDescriptor, TransferError, raise_for
from kv_transfer.transports import Transport, packed

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1"
ETCD_PREFIX = "/dynamo_pd/kv_transfer/nixl/"
# Packing costs a round trip and a registration (~1-2 ms): worth it from about this many regions
# (UCX spends ~10 us on each); a 64 MiB pull of scattered native-layout blocks has ~5000.
PACK_MIN_REGIONS = 512


def _nixl_api():
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as e:
        raise ImportError(f"the nixl KV transport needs NIXL: {INSTALL_HINT} ({e})") from e
    return nixl_agent, nixl_agent_config


class NixlTransport(Transport):
    name = "nixl"

    def __init__(self, memory, engine_id, client, config):
        super().__init__(memory, engine_id, client, config)
        nixl_agent, nixl_agent_config = _nixl_api()
        self._name = f"{engine_id}-{uuid.uuid4().hex[:8]}"
        self._agent = nixl_agent(self._name, nixl_agent_config(backends=["UCX"]))
        self._registration = self._agent.register_memory(memory.buffers)
        self._peers: set[str] = set()
        self._etcd = None

    @property
    def agent_name(self) -> str:
        return self._name

    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    async def start(self, endpoint: str) -> None:
        if self.config.metadata_store:
            self._etcd = await _etcd_client(self.config.metadata_store)
            await self._etcd.put((ETCD_PREFIX + self._name).encode(), self.metadata())

    async def _connect(self, desc: TransferDescriptor, timeout: float) -> str:
        if desc.agent_name in self._peers:
            return desc.agent_name
        if self._etcd is not None:
            found = await asyncio.wait_for(self._etcd.get((ETCD_PREFIX + desc.agent_name).encode()), timeout)
            if found is None:
                raise PeerLostError(f"no NIXL metadata for agent {desc.agent_name!r} in etcd")
            metadata = found.value
        else:
            metadata = raise_for(await self.client.call(desc.endpoint, GetMetadata(), timeout)).payload
        name = self._agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else name
        if name != desc.agent_name:
            raise PeerLostError(f"{desc.endpoint} answered as NIXL agent {name!r}, not {desc.agent_name!r}")
        self._peers.add(name)
        return name

    async def read(self, desc, plan, timeout) -> None:
        peer = await self._connect(desc, timeout)
        if (len(plan.remote_rows) >= PACK_MIN_REGIONS and packed(plan.remote_rows)
                and desc.mem_type == "DRAM" and plan.local.device.type == "cpu"):
            await self._read_packed(peer, desc, plan, timeout)
            return
        await self._transfer("READ", peer, plan.local, plan.local.addresses(plan.local_rows),
                             _remote_rows(desc, plan.remote_rows), desc.mem_type, timeout)

    async def write(self, desc, plan, timeout) -> None:
        peer = await self._connect(desc, timeout)
        await self._transfer("WRITE", peer, plan.local, plan.local.addresses(plan.local_rows),
                             _remote_rows(desc, plan.remote_rows), desc.mem_type, timeout)

    async def _read_packed(self, peer: str, desc: TransferDescriptor, plan: TransferPlan, timeout: float) -> None:
        """Scattered small regions cost UCX ~10 us each: have the holder pack them (Pack) and read
        one region, straight into a conversion staging buffer (whose bytes are in the same order)
        or into a pooled buffer scattered afterwards."""
        nbytes = plan.nbytes
        reply = raise_for(await self.client.call(desc.endpoint, Pack(desc.request_id, plan.remote_ids), timeout))
        self._agent.add_remote_agent(reply.payload[8:])  # partial metadata: the packed buffer's registration
        remote = np.array([[int.from_bytes(reply.payload[:8], "little"), nbytes, 0]], dtype=np.uint64)
        if plan.local is not self.memory:  # staging in the holder's format: packed order is its layout
            local = plan.local.addresses(np.array([[0, 0, nbytes]], dtype=np.int64))
            await self._transfer("READ", peer, plan.local, local, remote, "DRAM", timeout)
            return
        buffer = STAGING.take(nbytes)
        try:
            local = np.array([[buffer.data_ptr(), nbytes, 0]], dtype=np.uint64)
            await self._transfer("READ", peer, buffer, local, remote, "DRAM", timeout)
            await asyncio.to_thread(plan.local.scatter, plan.local_ids, buffer[:nbytes])
        finally:
            STAGING.give(buffer)

    def expose(self, buffer: torch.Tensor) -> tuple[bytes, Callable[[], None]]:
        registration = self._agent.register_memory([buffer])
        partial = self._agent.get_partial_agent_metadata(registration, False)
        return partial, lambda: self._agent.deregister_memory(registration)

    async def _transfer(self, op: str, peer: str, local_memory: KVMemory | torch.Tensor, local: np.ndarray,
                        remote: np.ndarray, remote_mem_type: str, timeout: float) -> None:
        """One NIXL request over (address, length, device) rows. Local memory other than the cache
        (a conversion staging area, a pooled buffer) is registered for this transfer only."""
        if isinstance(local_memory, KVMemory):
            tensors, mem_type = local_memory.buffers, local_memory.mem_type
        else:
            tensors, mem_type = [local_memory], "DRAM"
        registration = None if local_memory is self.memory else self._agent.register_memory(tensors)
        handle = None
        try:
            local_descs = self._agent.get_xfer_descs(local, mem_type)
            remote_descs = self._agent.get_xfer_descs(remote, remote_mem_type)
            handle = self._agent.initialize_xfer(op, local_descs, remote_descs, peer)
            state = self._agent.transfer(handle)
            deadline, delay = time.monotonic() + timeout, 0.0001
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise PeerLostError(f"NIXL {op} from {peer} not done within {timeout:.1f}s")
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.002)
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise PeerLostError(f"NIXL {op} with {peer} failed (state {state})")
        except PeerLostError:
            self._forget(peer)
            raise
        except Exception as e:  # NIXL raises its own errors for unreachable or invalid peers
            self._forget(peer)
            raise PeerLostError(f"NIXL {op} with {peer} failed: {e}") from e
        finally:
            if handle is not None:
                try:
                    self._agent.release_xfer_handle(handle)
                except Exception as e:  # an active transfer to a dead peer may refuse to cancel
                    log.warning("NIXL transfer handle not released: %s", e)
            if registration is not None:
                self._agent.deregister_memory(registration)

    def _forget(self, peer: str) -> None:
        if peer in self._peers:
            self._peers.discard(peer)
            try:
                self._agent.remove_remote_agent(peer)
            except Exception as e:
                log.warning("NIXL remove_remote_agent(%s): %s", peer, e)

    async def close(self) -> None:
        for peer in list(self._peers):
            self._forget(peer)
        if self._etcd is not None:
            try:
                await self._etcd.delete((ETCD_PREFIX + self._name).encode())
            finally:
                await self._etcd.close()
        self._agent.deregister_memory(self._registration)


def _remote_rows(desc: TransferDescriptor, rows: np.ndarray) -> np.ndarray:
    """Region rows of the holder's memory as (address, length, device) rows."""
    out = np.empty((len(rows), 3), dtype=np.uint64)
    out[:, 0] = np.asarray(desc.base_addrs, dtype=np.uint64)[rows[:, 0]] + rows[:, 1].astype(np.uint64)
    out[:, 1] = rows[:, 2]
    out[:, 2] = desc.device_id
    return out


async def _etcd_client(address: str):
    url = urlparse(address)
    if url.scheme != "etcd" or not url.hostname:
        raise ValueError(f"metadata_store must look like etcd://host:port, got {address!r}")
    try:
        import aetcd
    except ImportError as e:
        raise ImportError("etcd metadata needs aetcd: pip install aetcd") from e
    client = aetcd.Client(host=url.hostname, port=url.port or 2379, timeout=5)
    try:
        await client.connect()
    except Exception as e:
        raise TransferError(f"cannot reach etcd at {address}: {e}") from e
    return client
