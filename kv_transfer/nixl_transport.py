"""NIXL transport: one-sided UCX reads and writes straight between the two caches (DRAM or VRAM).

Each agent registers its whole cache once. A peer's NIXL metadata is fetched once per peer agent,
over the side channel or from etcd (`metadata_store="etcd://host:port"`, key
/dynamo_pd/kv_transfer/nixl/<agent>), and loaded with add_remote_agent. A transfer is one
initialize_xfer over the coalesced regions (one descriptor per run of consecutive blocks per
outer combination: per run for the native engine's block-major cache, per run and layer and K/V for
per-layer layouts), polled with growing sleeps on the event loop (check_xfer_state never blocks)
until done, failed or `timeout` runs out. Scattered small regions (a per-layer layout's) are read
packed: the holder gathers them into one registered buffer on request (Pack) and the reader issues
a single descriptor.

A transfer that failed, timed out or was cancelled returns (and its memory goes back to its owner)
only once NIXL reports it ended: releasing a handle in progress does not stop UCX (its backend frees
the request, the bytes still land), and removing the remote agent only makes NIXL stop reporting
on it. One that does not end within `timeout_s` more is stopped by destroying the NIXL agent (a
fresh one takes its name); a remote agent is removed only when no transfer to it runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
import uuid
import weakref
from collections import Counter
from collections.abc import Callable
from urllib.parse import urlparse

import numpy as np
import torch

from kv_transfer.memory import STAGING, KVMemory
from kv_transfer.plan import TransferPlan
from kv_transfer.protocol import GetMetadata, Pack, PeerLostError, TransferDescriptor, TransferError, raise_for
from kv_transfer.transports import Transport, packed, to_the_end

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1"
ETCD_PREFIX = "/dynamo_pd/kv_transfer/nixl/"
# Packing costs a round trip and a registration (~1-2 ms): worth it from about this many regions
# (UCX spends ~10 us on each); a 64 MiB pull of scattered blocks has ~5000 in a per-layer layout (vLLM's),
# 91 in the native engine's block-major one (never packed).
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
        _nixl_api()
        self._name = f"{engine_id}-{uuid.uuid4().hex[:8]}"
        self._new_agent()
        self._peers: set[str] = set()
        self._active: Counter[str] = Counter()  # transfers in flight per peer agent
        self._stale: set[str] = set()  # peers to remove once their transfers are over
        self._etcd = None
        self.torn_down = 0  # NIXL agents destroyed because a transfer would not end

    def _new_agent(self) -> None:
        nixl_agent, nixl_agent_config = _nixl_api()
        self._agent = nixl_agent(self._name, nixl_agent_config(backends=["UCX"]))
        self._registration = self._agent.register_memory(self.memory.buffers)
        self._destroyed = asyncio.Event()  # set once the NIXL agent (and its UCX worker) is gone
        weakref.finalize(self._agent, self._destroyed.set)

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
            async with asyncio.timeout(timeout):
                found = await self._etcd.get((ETCD_PREFIX + desc.agent_name).encode())
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
            await to_the_end(asyncio.to_thread(plan.local.scatter, plan.local_ids, buffer[:nbytes]))
        finally:
            STAGING.give(buffer)

    def expose(self, buffer: torch.Tensor) -> tuple[bytes, Callable[[], None]]:
        registration = self._agent.register_memory([buffer])
        partial = self._agent.get_partial_agent_metadata(registration, False)
        agent = weakref.ref(self._agent)  # a torn-down agent took the registration with it
        return partial, lambda: (a := agent()) is not None and a.deregister_memory(registration)

    async def _transfer(self, op: str, peer: str, local_memory: KVMemory | torch.Tensor, local: np.ndarray,
                        remote: np.ndarray, remote_mem_type: str, timeout: float) -> None:
        """One NIXL request over (address, length, device) rows. Local memory other than the cache
        (a conversion staging area, a pooled buffer) is registered for this transfer only."""
        if isinstance(local_memory, KVMemory):
            tensors, mem_type = local_memory.buffers, local_memory.mem_type
        else:
            tensors, mem_type = [local_memory], "DRAM"
        agent, destroyed = self._agent, self._destroyed  # a handle belongs to the agent that made it
        registration = None if local_memory is self.memory else agent.register_memory(tensors)
        handle = None
        self._active[peer] += 1
        try:
            local_descs = agent.get_xfer_descs(local, mem_type)
            remote_descs = agent.get_xfer_descs(remote, remote_mem_type)
            handle = agent.initialize_xfer(op, local_descs, remote_descs, peer)
            state = agent.transfer(handle)
            deadline = time.monotonic() + timeout
            state = await self._poll(agent, handle, state, deadline)
            if agent is not self._agent:
                raise PeerLostError(f"NIXL {op} with {peer} stopped: its NIXL agent was torn down")
            if state == "PROC":
                raise PeerLostError(f"NIXL {op} from {peer} not done within {timeout:.1f}s")
            if state != "DONE":
                raise PeerLostError(f"NIXL {op} with {peer} failed (state {state})")
        except BaseException as e:
            if handle is not None:  # the memory goes back to its owner only once the transfer ended
                settled = await to_the_end(self._settle(agent, handle))
                if not settled:  # drop every reference this call has to the agent, then destroy it
                    traceback.clear_frames(e.__traceback__)
                    handle = registration = agent = None
                    await to_the_end(self._destroy(destroyed))
            self._forget(peer)
            if isinstance(e, (TransferError, asyncio.CancelledError)) or not isinstance(e, Exception):
                raise
            raise PeerLostError(f"NIXL {op} with {peer} failed: {e}") from e
        finally:
            self._active[peer] -= 1
            if not self._active[peer]:
                del self._active[peer]
                if peer in self._stale:
                    self._forget(peer)
            if handle is not None:  # ended: releasing it frees NIXL's request and nothing else
                agent.release_xfer_handle(handle)
            if registration is not None:
                agent.deregister_memory(registration)

    async def _poll(self, agent, handle, state: str, deadline: float) -> str:
        """Poll with growing sleeps until the transfer leaves PROC, `deadline` passes or `agent` is torn
        down. NIXL raises on a transfer the backend failed (NIXL_ERR_REMOTE_DISCONNECT: UCX failed the
        endpoint and every request on it) or whose peer NIXL invalidated after such a failure (this
        transport removes none while transfers to it run): both mean it ended, as "ERR"."""
        delay = 0.0001
        while state == "PROC" and time.monotonic() < deadline and agent is self._agent:
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.002)
            try:
                state = agent.check_xfer_state(handle)
            except Exception as e:  # noqa: BLE001 - NIXL's status errors
                return f"ERR ({type(e).__name__}: {e})"
        return state

    async def _settle(self, agent, handle) -> bool:
        """After a failure: True once the transfer is known to have ended, False if it still runs after
        timeout_s more (or its agent was torn down meanwhile)."""
        state = await self._poll(agent, handle, "PROC", time.monotonic() + self.config.timeout_s)
        return state != "PROC" and agent is self._agent

    async def _destroy(self, destroyed: asyncio.Event) -> None:
        """Stop transfers that will not end: destroy their NIXL agent, so its UCX worker moves no more
        bytes into memory about to be reused, and start a fresh one under the same name. Transfers
        still polling the old agent notice, give it up and wait here too, until it is gone."""
        if destroyed is self._destroyed:  # the first to give up on this agent replaces it
            log.error("a NIXL transfer of %s does not end; destroying its NIXL agent", self._name)
            self.torn_down += 1
            self._new_agent()
            self._peers.clear()
            self._stale.clear()
            if self._etcd is not None:  # peers fetch the fresh agent's metadata by the same name
                await self._etcd.put((ETCD_PREFIX + self._name).encode(), self.metadata())
        try:
            async with asyncio.timeout(self.config.timeout_s):
                await destroyed.wait()
        except asyncio.TimeoutError:
            log.error("the old NIXL agent of %s is still referenced; a stopped transfer may yet land", self._name)

    def _forget(self, peer: str) -> None:
        """Remove a failed peer's agent, so the next transfer loads its metadata afresh; while other
        transfers to it run, only after the last (removing it would blind NIXL to their end)."""
        if peer not in self._peers:
            return
        if self._active[peer]:
            self._stale.add(peer)
            return
        self._peers.discard(peer)
        self._stale.discard(peer)
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
