"""Transports: how bytes of paired regions move between two agents' memories.

`Transport.read` copies remote rows -> local rows, `write` local -> remote; rows are the
(buffer, offset, length) region lists of kv_transfer.layout, in stream order. Control
(Begin/Finish, leases) stays in the agent; a transport only moves bytes.

    inproc  both agents in one process: a direct tensor copy (aggregated workers, tests)
    zmq     bytes ride the side channel as ~1 MiB zero-copy frames (tcp or ipc); CPU memory only
    nixl    one-sided UCX reads/writes (kv_transfer.nixl_transport), DRAM or VRAM

Bulk copies (gather, scatter, in-process copies) run in worker threads: numpy releases the GIL,
and the worker's event loop keeps streaming tokens meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import ClassVar

import numpy as np
import torch
import zmq

from kv_transfer.config import TransferConfig
from kv_transfer.memory import STAGING, KVMemory
from kv_transfer.plan import TransferPlan
from kv_transfer.protocol import Fetch, PeerLostError, TransferDescriptor, TransferError, Write, raise_for
from kv_transfer.side_channel import SideChannelClient


# Regions smaller than this on average (scattered blocks of a layout that splits each block per
# layer and K/V) move faster packed into one buffer (KVMemory.gather/scatter) than frame by frame.
PACK_BELOW = 256 << 10


def packed(rows: np.ndarray) -> bool:
    return len(rows) > 0 and rows[:, 2].mean() < PACK_BELOW


class Transport:
    name: ClassVar[str]

    def __init__(self, memory: KVMemory, engine_id: str, client: SideChannelClient, config: TransferConfig):
        self.memory = memory
        self.engine_id = engine_id
        self.client = client
        self.config = config

    @property
    def agent_name(self) -> str:
        return ""

    async def start(self, endpoint: str) -> None:
        """Called once the side channel is bound at `endpoint`."""

    def metadata(self) -> bytes:
        """What a peer needs to reach this agent's memory (NIXL agent metadata)."""
        return b""

    def expose(self, buffer: torch.Tensor) -> tuple[bytes, Callable[[], None]]:
        """Make a packed buffer readable by peers: (metadata a peer loads to reach it, undo). NIXL only."""
        raise TransferError(f"the {self.name} transport reads no packed buffers")

    async def read(self, desc: TransferDescriptor, plan: TransferPlan, timeout: float) -> None:
        """Copy the peer's plan.remote_ids into plan.local's plan.local_ids."""
        raise NotImplementedError

    async def write(self, desc: TransferDescriptor, plan: TransferPlan, timeout: float) -> None:
        """Copy plan.local's plan.local_ids into the peer's plan.remote_ids."""
        raise NotImplementedError

    async def close(self) -> None:
        """Release what start() acquired."""


# -- in-process -----------------------------------------------------------------------------

_INPROC_MEMORY: dict[str, KVMemory] = {}


class InProcessTransport(Transport):
    name = "inproc"

    async def start(self, endpoint: str) -> None:
        if self.engine_id in _INPROC_MEMORY:
            raise ValueError(f"engine id {self.engine_id!r} already has an in-process KV agent")
        _INPROC_MEMORY[self.engine_id] = self.memory

    def _peer(self, desc: TransferDescriptor) -> KVMemory:
        peer = _INPROC_MEMORY.get(desc.engine_id)
        if peer is None:
            raise PeerLostError(f"no in-process KV agent for engine {desc.engine_id!r} (closed?)")
        return peer

    async def read(self, desc, plan, timeout) -> None:
        await to_the_end(asyncio.to_thread(copy_blocks, self._peer(desc), plan.remote_ids, plan.remote_rows,
                                           plan.local, plan.local_ids, plan.local_rows))

    async def write(self, desc, plan, timeout) -> None:
        await to_the_end(asyncio.to_thread(copy_blocks, plan.local, plan.local_ids, plan.local_rows,
                                           self._peer(desc), plan.remote_ids, plan.remote_rows))

    async def close(self) -> None:
        if _INPROC_MEMORY.get(self.engine_id) is self.memory:
            del _INPROC_MEMORY[self.engine_id]


async def to_the_end(aw):
    """Await `aw` to its end even if the caller is cancelled meanwhile (then re-raise the cancel): a
    copy in a worker thread or a NIXL transfer goes on regardless, and the memory it touches must not
    go back to its owner before it ends."""
    task = asyncio.ensure_future(aw)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = cancelled or not task.done()
    if cancelled:
        raise asyncio.CancelledError
    return task.result()


def copy_blocks(src: KVMemory, src_ids: list[int], src_rows: np.ndarray,
                dst: KVMemory, dst_ids: list[int], dst_rows: np.ndarray) -> None:
    """Same-format block copy between two memories of this process."""
    if packed(src_rows) and src.device.type == dst.device.type == "cpu":
        nbytes = int(src_rows[:, 2].sum())
        buffer = STAGING.take(nbytes)
        dst.scatter(dst_ids, src.gather(src_ids, buffer[:nbytes]))
        STAGING.give(buffer)
        return
    on_cpu = src.device.type == dst.device.type == "cpu"
    for (sb, so, n), (db, do, _) in zip(src_rows.tolist(), dst_rows.tolist()):
        if on_cpu:  # a plain memcpy: torch's threaded copy_ stalls on a busy machine
            np.copyto(dst.region(db, do, n).numpy(), src.region(sb, so, n).numpy())
        else:
            dst.region(db, do, n).copy_(src.region(sb, so, n))


# -- ZMQ ------------------------------------------------------------------------------------


class ZmqTransport(Transport):
    name = "zmq"

    def __init__(self, memory: KVMemory, engine_id: str, client: SideChannelClient, config: TransferConfig):
        if memory.device.type != "cpu":
            raise TransferError(f"the zmq transport moves CPU memory; the cache is on {memory.device}: use nixl")
        super().__init__(memory, engine_id, client, config)

    async def read(self, desc, plan, timeout) -> None:
        sink = ByteSink(plan.local, plan.local_ids, plan.local_rows)
        reply = await self.client.call(desc.endpoint, Fetch(desc.request_id, plan.remote_ids), timeout,
                                       on_data=sink.write_frames)
        raise_for(reply)
        await to_the_end(asyncio.to_thread(sink.finish))

    async def write(self, desc, plan, timeout) -> None:
        frames, buffer = await asyncio.to_thread(block_frames, plan.local, plan.local_ids, plan.local_rows,
                                                 self.config.frame_bytes)
        try:
            raise_for(await self.client.call(desc.endpoint, Write(desc.request_id, plan.remote_ids), timeout,
                                             frames=frames))
        finally:
            if buffer is not None:  # reused even on failure: only a dead peer could still be sent it
                STAGING.give(buffer)


def block_frames(memory: KVMemory, block_ids: list[int], rows: np.ndarray,
                 frame_bytes: int) -> tuple[list[memoryview], torch.Tensor | None]:
    """The blocks' bytes in stream order as views of at most frame_bytes: zero-copy over the cache
    when regions are large, else over one packed copy, returned too: give it back to STAGING once
    the peer has received everything."""
    if packed(rows):
        nbytes = int(rows[:, 2].sum())
        buffer = STAGING.take(nbytes)
        data = memory.gather(block_ids, buffer[:nbytes]).numpy()
        return [memoryview(data[i : i + frame_bytes]) for i in range(0, nbytes, frame_bytes)], buffer
    views = [memoryview(memory.byte_view(b).numpy()) for b in range(len(memory.buffers))]
    frames = [views[buffer][start : min(start + frame_bytes, offset + length)]
              for buffer, offset, length in rows.tolist()
              for start in range(offset, offset + length, frame_bytes)]
    return frames, None


async def stream_frames(frames: list[memoryview], send: Callable[[Sequence], Awaitable[None]],
                        frames_per_message: int = 8) -> None:
    """Send frames as data messages of a few frames each, so the reader starts early."""
    for i in range(0, len(frames), frames_per_message):
        await send(frames[i : i + frames_per_message])


class ByteSink:
    """Writes an incoming stream-order byte stream into blocks: straight into the regions when they
    are large, else into one packed buffer scattered at finish()."""

    def __init__(self, memory: KVMemory, block_ids: list[int], rows: np.ndarray):
        self._memory, self._ids = memory, block_ids
        self.expected = int(rows[:, 2].sum()) if len(rows) else 0
        self._buffer = STAGING.take(self.expected) if packed(rows) else None
        if self._buffer is not None:
            self._targets = [self._buffer[: self.expected].numpy()]
        else:
            self._targets = [memory.region(b, o, n).numpy() for b, o, n in rows.tolist()]
        self._row, self._pos = 0, 0
        self.received = 0

    def write_frames(self, frames: Sequence[zmq.Frame | bytes | memoryview]) -> None:
        for frame in frames:
            data = np.frombuffer(frame.buffer if isinstance(frame, zmq.Frame) else frame, dtype=np.uint8)
            if self.received + len(data) > self.expected:
                raise PeerLostError(f"peer sent more than the {self.expected} bytes asked for")
            self.received += len(data)
            while len(data):
                target = self._targets[self._row]
                n = min(len(data), len(target) - self._pos)
                target[self._pos : self._pos + n] = data[:n]
                data, self._pos = data[n:], self._pos + n
                if self._pos == len(target):
                    self._row, self._pos = self._row + 1, 0

    def finish(self) -> None:
        if self.received != self.expected:
            raise PeerLostError(f"stream ended after {self.received} of {self.expected} bytes")
        if self._buffer is not None:
            self._memory.scatter(self._ids, self._buffer[: self.expected])
            STAGING.give(self._buffer)
            self._buffer = None


def make_transport(memory: KVMemory, engine_id: str, client: SideChannelClient, config: TransferConfig) -> Transport:
    if config.transport == "nixl":
        from kv_transfer.nixl_transport import NixlTransport

        return NixlTransport(memory, engine_id, client, config)
    cls = {"zmq": ZmqTransport, "inproc": InProcessTransport}[config.transport]
    return cls(memory, engine_id, client, config)
