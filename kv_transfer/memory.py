"""The memory behind a KVLayout: the engine's own tensors, viewed as bytes or as logical blocks."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kv_transfer.layout import AXES, DTYPES, KVLayout


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
        """Wrap the native engine's single cache tensor [L, 2, num_blocks, block_size, H, D]."""
        return cls(KVLayout.native(kv_cache, model), [kv_cache])

    @classmethod
    def allocate(cls, layout: KVLayout, device: str | torch.device = "cpu") -> KVMemory:
        dtype = DTYPES[layout.dtype]
        return cls(layout, [torch.zeros(layout.buffer_shape, dtype=dtype, device=device)
                            for _ in range(layout.num_buffers)])

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
