"""The memory behind a KVLayout: the engine's own tensors, viewed as bytes or as logical blocks."""

from __future__ import annotations

import math
import mmap
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kv_transfer.layout import AXES, KVLayout

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn, "uint8": torch.uint8,
}


def kv_zeros(shape: Sequence[int], dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
    """A zeroed KV pool. On the CPU: anonymous memory advised onto transparent huge pages, because a
    transfer pins and copies it page by page (UCX's CMA), and 2 MiB pages took NIXL's pulls from about
    0.45 to 0.65 of memcpy (benchmarks/transfer_bench.py). Every page is touched now, as torch.zeros
    would: the cache is resident from the start, so a worker sizing its own from free memory sees it."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(tuple(shape), dtype=dtype, device=device)
    try:
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:  # in torch's allocator's words, as before
        size = f"{nbytes / 2**30:.2f} GiB"
        raise RuntimeError(f"can't allocate memory: the KV pool needs {size} ({exc.strerror})") from None
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: 4 KiB pages, slower transfers
        pass
    return torch.frombuffer(region, dtype=dtype).view(tuple(shape)).zero_()  # it keeps `region` mapped


@dataclass
class KVMemory:
    """An engine's KV cache tensors described by `layout` (one tensor, or one per layer).

    The tensors are used in place: transfers read and write the engine's memory directly.
    """

    layout: KVLayout
    buffers: list[torch.Tensor]
    _bytes: list[torch.Tensor] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        layout = self.layout
        if len(self.buffers) != layout.num_buffers:
            raise ValueError(f"layout needs {layout.num_buffers} buffers, got {len(self.buffers)}")
        for i, buf in enumerate(self.buffers):
            if not buf.is_contiguous():
                raise ValueError(f"KV buffer {i} must be contiguous")
            if buf.dtype != DTYPES[layout.dtype]:
                raise ValueError(f"KV buffer {i} has dtype {buf.dtype}, layout says {layout.dtype}")
            if buf.numel() * buf.element_size() != layout.buffer_bytes:
                raise ValueError(
                    f"KV buffer {i} has {buf.numel() * buf.element_size()} bytes, layout "
                    f"{layout.buffer_shape} needs {layout.buffer_bytes}"
                )
            if buf.device != self.buffers[0].device:
                raise ValueError("all KV buffers must live on one device")
        self._bytes = [b.view(-1).view(torch.uint8) for b in self.buffers]

    @classmethod
    def native(cls, kv_cache: torch.Tensor, model: str) -> KVMemory:
        """Wrap a native-style cache tensor indexed [L, 2, num_blocks, block_size, H, D], in memory in
        any order (KVLayout.native): the buffer is the same memory viewed in that order."""
        layout = KVLayout.native(kv_cache, model)
        return cls(layout, [kv_cache.permute([AXES.index(a) for a in layout.order])])

    @classmethod
    def allocate(cls, layout: KVLayout, device: str | torch.device = "cpu") -> KVMemory:
        dtype = DTYPES[layout.dtype]
        return cls(layout, [kv_zeros(layout.buffer_shape, dtype, device) for _ in range(layout.num_buffers)])

    @property
    def device(self) -> torch.device:
        return self.buffers[0].device

    @property
    def mem_type(self) -> str:
        return "DRAM" if self.device.type == "cpu" else "VRAM"

    @property
    def device_id(self) -> int:
        return self.device.index or 0 if self.device.type != "cpu" else 0

    def base_addrs(self) -> list[int]:
        return [b.data_ptr() for b in self.buffers]

    def byte_view(self, buffer: int) -> torch.Tensor:
        return self._bytes[buffer]

    def region(self, buffer: int, offset: int, length: int) -> torch.Tensor:
        return self._bytes[buffer][offset : offset + length]

    def addresses(self, rows: np.ndarray) -> np.ndarray:
        """Region rows (buffer, offset, length) as NIXL's (address, length, device id) rows."""
        bases = np.asarray(self.base_addrs(), dtype=np.uint64)
        out = np.empty((len(rows), 3), dtype=np.uint64)
        out[:, 0] = bases[rows[:, 0]] + rows[:, 1].astype(np.uint64)
        out[:, 1] = rows[:, 2]
        out[:, 2] = self.device_id
        return out

    def block_views(self) -> list[torch.Tensor]:
        """Per buffer, [outer combinations, num_blocks, chunk] in the widest integer type dividing a
        chunk (see layout.py): what gather and scatter index along dim 1."""
        layout = self.layout
        outer = len(layout.outer_offsets()) // layout.num_buffers
        wide = _widest(layout.chunk_bytes)
        return [b.view(wide).view(outer, layout.num_blocks, -1) for b in self._bytes]

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> torch.Tensor:
        """Pack the blocks' bytes in stream order (what block_regions rows yield) into `out`, a flat
        uint8 tensor of exactly that size."""
        for view, part in self._pairs(block_ids, out):
            if self.device.type == "cpu":  # numpy: one strided memcpy per run, no thread-pool stalls
                src, dst = view.numpy(), part.numpy()
                for start, pos, n in _runs(block_ids):
                    dst[:, pos : pos + n] = src[:, start : start + n]
            else:
                torch.index_select(view, 1, torch.as_tensor(block_ids, device=self.device), out=part)
        return out

    def scatter(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Inverse of gather: write packed stream-order bytes into the blocks."""
        for view, part in self._pairs(block_ids, data):
            if self.device.type == "cpu":
                src, dst = part.numpy(), view.numpy()
                for start, pos, n in _runs(block_ids):
                    dst[:, start : start + n] = src[:, pos : pos + n]
            else:
                view.index_copy_(1, torch.as_tensor(block_ids, device=self.device), part.to(self.device))

    def _pairs(self, block_ids: Sequence[int], packed: torch.Tensor) -> zip:
        views = self.block_views()
        parts = packed.view(views[0].dtype).view(len(views), views[0].shape[0], len(block_ids), -1)
        return zip(views, parts)

    def layer_view(self, layer: int) -> torch.Tensor:
        """Layer `layer` as a [2, num_blocks, block_size, H, D] view of the engine's memory."""
        layout = self.layout
        if layout.buffer_per_layer:
            shaped = self.buffers[layer].view(layout.buffer_shape)
            order = layout.order[1:]
            return shaped.permute(*[order.index(a) for a in AXES[1:]])
        shaped = self.buffers[0].view(layout.buffer_shape)
        return shaped.permute(*[layout.order.index(a) for a in AXES])[layer]


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first block id, position in block_ids, length) of each run of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    for pos, block in enumerate(block_ids):
        if runs and runs[-1][0] + runs[-1][2] == block:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((block, pos, 1))
    return runs


def _widest(nbytes: int) -> torch.dtype:
    return next(t for t in (torch.int64, torch.int32, torch.int16, torch.uint8) if nbytes % t.itemsize == 0)


class BufferPool:
    """Reusable CPU byte buffers for packing and staging: a fresh 64 MiB allocation costs more in
    page faults than the copy into it. Thread-safe; keeps at most `keep` idle buffers."""

    def __init__(self, keep: int = 4):
        self._idle: list[torch.Tensor] = []
        self._keep = keep
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least nbytes; hand it back with give() once nothing reads it."""
        with self._lock:  # the smallest idle buffer that fits (indices: tensors do not compare by ==)
            fits = [i for i, b in enumerate(self._idle) if b.numel() >= nbytes]
            if fits:
                return self._idle.pop(min(fits, key=lambda i: self._idle[i].numel()))
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._idle.append(buffer)
            self._idle.sort(key=lambda b: b.numel())
            del self._idle[: -self._keep]  # keep the largest


STAGING = BufferPool()


class BlobPool:
    """Byte strings (llama.cpp sequence states) kept in fixed-size blocks, shaped as a native KV cache
    [1, 2, num_blocks, 1, 1, block_bytes // 2] of uint8, so KVMemory.native(pool.tensor, model) lets
    the KV transfer agent hold, pull and push them like KV blocks. A blob is stored with an 8-byte
    length in front; block i of a blob holds its bytes [i * block_bytes, (i + 1) * block_bytes), the
    first half in K and the second in V. Allocation is thread-safe."""

    HEADER = 8

    def __init__(self, num_blocks: int, block_bytes: int):
        if num_blocks < 1 or block_bytes < 2 or block_bytes % 2:
            raise ValueError(
                f"a blob pool needs >= 1 block of an even number of bytes, got {num_blocks} x {block_bytes}"
            )
        self.block_bytes = block_bytes
        self.tensor = torch.empty((1, 2, num_blocks, 1, 1, block_bytes // 2), dtype=torch.uint8)  # pages on first use
        self._free = list(range(num_blocks - 1, -1, -1))
        self._lock = threading.Lock()

    @property
    def num_blocks(self) -> int:
        return self.tensor.shape[2]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, nbytes: int) -> int:
        return -(-(nbytes + self.HEADER) // self.block_bytes)

    def allocate(self, num_blocks: int) -> list[int]:
        with self._lock:
            if num_blocks > len(self._free):
                raise MemoryError(f"blob pool: {num_blocks} blocks wanted, {len(self._free)} of "
                                  f"{self.num_blocks} free")
            return [self._free.pop() for _ in range(num_blocks)]

    def free(self, block_ids: Sequence[int]) -> None:
        with self._lock:
            self._free.extend(block_ids)

    def write(self, block_ids: Sequence[int], data: bytes | memoryview) -> None:
        """Store `data` (with its length) in `block_ids`, at least enough blocks (the rest are zeroed)."""
        if len(block_ids) < self.blocks_for(len(data)):
            raise ValueError(f"{len(data)} bytes need {self.blocks_for(len(data))} blocks, got {len(block_ids)}")
        packed = np.zeros(len(block_ids) * self.block_bytes, dtype=np.uint8)
        packed[: self.HEADER] = np.frombuffer(len(data).to_bytes(self.HEADER, "little"), dtype=np.uint8)
        packed[self.HEADER : self.HEADER + len(data)] = np.frombuffer(data, dtype=np.uint8)
        halves = torch.from_numpy(packed).view(len(block_ids), 2, -1)
        ids = torch.as_tensor(list(block_ids))
        self.tensor[0, 0, ids, 0, 0] = halves[:, 0]
        self.tensor[0, 1, ids, 0, 0] = halves[:, 1]

    def read(self, block_ids: Sequence[int]) -> bytes:
        """The blob `write` stored in `block_ids` (or a transfer filled them with)."""
        ids = torch.as_tensor(list(block_ids))
        packed = torch.stack([self.tensor[0, 0, ids, 0, 0], self.tensor[0, 1, ids, 0, 0]], dim=1).view(-1)
        nbytes = int.from_bytes(packed[: self.HEADER].numpy().tobytes(), "little")
        if nbytes > len(packed) - self.HEADER:
            raise ValueError(f"blocks {list(block_ids)} hold no blob: its length {nbytes} exceeds them")
        return packed[self.HEADER : self.HEADER + nbytes].numpy().tobytes()
