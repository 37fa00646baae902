"""Planning one transfer: which remote blocks pair with which local ones, and the conversion
around the copy when the layouts differ (read into / write from a staging buffer in the sender's
format, convert locally with kv_transfer.convert)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kv_transfer.convert import copy_tokens
from kv_transfer.layout import paired_regions
from kv_transfer.memory import KVMemory
from kv_transfer.protocol import TransferDescriptor


@dataclass(frozen=True)
class TransferPlan:
    """Blocks and matching regions of one transfer; `local` is the cache or a staging buffer."""

    remote_ids: list[int]
    remote_rows: np.ndarray
    local: KVMemory
    local_ids: list[int]
    local_rows: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.local_rows[:, 2].sum()) if len(self.local_rows) else 0


Planned = tuple[TransferPlan | None, Callable[[], None] | None]  # None plan: nothing to move


def pull_plan(desc: TransferDescriptor, memory: KVMemory, local_ids: Sequence[int], skip_blocks: int) -> Planned:
    """Plan reading the blocks of `desc` from block `skip_blocks` on into `local_ids` of `memory`."""
    src, dst = desc.layout, memory.layout
    total = math.ceil(desc.num_tokens / dst.block_size)
    if skip_blocks < 0 or skip_blocks + len(local_ids) != total:
        raise ValueError(f"pull {desc.request_id!r}: {skip_blocks} cached + {len(local_ids)} new blocks "
                         f"!= {total} blocks for {desc.num_tokens} tokens")
    first_token = skip_blocks * dst.block_size
    if first_token >= desc.num_tokens:
        return None, None
    first, end = first_token // src.block_size, math.ceil(desc.num_tokens / src.block_size)
    if first < desc.block_offset or end > desc.block_offset + len(desc.block_ids):
        raise ValueError(f"{desc.request_id!r}: needs source blocks [{first}, {end}), descriptor holds "
                         f"[{desc.block_offset}, {desc.block_offset + len(desc.block_ids)})")
    remote_ids = desc.block_ids[first - desc.block_offset : end - desc.block_offset]
    if src.same_format(dst):
        remote_rows, local_rows = paired_regions(src, remote_ids, dst, local_ids)
        return TransferPlan(remote_ids, remote_rows, memory, list(local_ids), local_rows), None
    staging = KVMemory.allocate(src.with_blocks(len(remote_ids)), memory.device)
    staged_ids = list(range(len(remote_ids)))
    remote_rows, local_rows = paired_regions(src, remote_ids, staging.layout, staged_ids)

    def convert() -> None:
        copy_tokens(staging, range(len(remote_ids)), memory, local_ids,
                    first_token - first * src.block_size, desc.num_tokens - first_token)

    return TransferPlan(remote_ids, remote_rows, staging, staged_ids, local_rows), convert

def push_plan(desc: TransferDescriptor, memory: KVMemory, local_ids: Sequence[int]) -> Planned:
    """Plan writing the request's blocks `local_ids` (from block 0) of `memory` into the blocks `desc` reserved."""
    src, dst = memory.layout, desc.layout
    first_token = desc.block_offset * dst.block_size
    if first_token >= desc.num_tokens:
        return None, None
    first, end = first_token // src.block_size, math.ceil(desc.num_tokens / src.block_size)
    if end > len(local_ids):
        raise ValueError(f"push {desc.request_id!r}: {len(local_ids)} local blocks, {end} needed "
                         f"for {desc.num_tokens} tokens")
    local_ids = list(local_ids)[first:end]
    if src.same_format(dst):
        local_rows, remote_rows = paired_regions(src, local_ids, dst, desc.block_ids)
        return TransferPlan(desc.block_ids, remote_rows, memory, local_ids, local_rows), None
    staging = KVMemory.allocate(dst.with_blocks(len(desc.block_ids)), memory.device)
    staged_ids = list(range(len(desc.block_ids)))
    copy_tokens(memory, local_ids, staging, staged_ids,
                first_token - first * src.block_size, desc.num_tokens - first_token)
    local_rows, remote_rows = paired_regions(staging.layout, staged_ids, dst, desc.block_ids)
    return TransferPlan(desc.block_ids, remote_rows, staging, staged_ids, local_rows), None
