"""Converting KV blocks between layouts: physical order (NHD <-> HND, K/V placement, per-layer or
packed), block size (re-blocking through the token stream) and KV-head split (tensor parallelism).

Both sides are seen through KVMemory.layer_view as [2, blocks, block_size, heads, head_dim], so one
routine covers every pair of layouts that `KVLayout.convertible` accepts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kv_transfer.memory import KVMemory


def copy_tokens(
    src: KVMemory,
    src_blocks: Sequence[int],
    dst: KVMemory,
    dst_blocks: Sequence[int],
    skip_tokens: int,
    num_tokens: int,
) -> None:
    """Copy tokens [skip_tokens, skip_tokens + num_tokens) of the token stream held in `src_blocks`
    to the start of the stream held in `dst_blocks`, converting layout on the way.

    Only the KV heads both sides hold are written: a destination rank with more heads than one
    source (merging TP ranks) calls this once per source. Slots past the last token of the final
    destination block are zero-filled.
    """
    s, d = src.layout, dst.layout
    problem = s.convertible(d)
    if problem:
        raise ValueError(problem)
    if skip_tokens < 0 or num_tokens <= 0:
        raise ValueError(f"bad token range: skip {skip_tokens}, count {num_tokens}")
    if skip_tokens + num_tokens > len(src_blocks) * s.block_size:
        raise ValueError(
            f"{len(src_blocks)} source blocks of {s.block_size} hold fewer than {skip_tokens + num_tokens} tokens"
        )
    if num_tokens > len(dst_blocks) * d.block_size:
        raise ValueError(f"{len(dst_blocks)} destination blocks of {d.block_size} cannot hold {num_tokens} tokens")
    lo = max(s.head_offset, d.head_offset)
    hi = min(s.head_offset + s.num_kv_heads, d.head_offset + d.num_kv_heads)
    src_idx = torch.as_tensor(list(src_blocks), dtype=torch.long, device=src.device)
    dst_idx = torch.as_tensor(list(dst_blocks), dtype=torch.long, device=dst.device)
    capacity = len(dst_blocks) * d.block_size
    for layer in range(s.num_layers):
        blocks = src.layer_view(layer)[:, src_idx, :, lo - s.head_offset : hi - s.head_offset]
        tokens = blocks.reshape(2, -1, hi - lo, s.head_dim)[:, skip_tokens : skip_tokens + num_tokens]
        if capacity > num_tokens:
            tokens = torch.nn.functional.pad(tokens, (0, 0, 0, 0, 0, capacity - num_tokens))
        reblocked = tokens.reshape(2, len(dst_blocks), d.block_size, hi - lo, d.head_dim)
        target = dst.layer_view(layer)
        target[:, dst_idx, :, lo - d.head_offset : hi - d.head_offset] = reblocked.to(dst.device)
