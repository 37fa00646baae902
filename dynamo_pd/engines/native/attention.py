"""Attention over the paged KV cache.

A step's tokens are flattened into one batch: first every single-token query (decodes, and
prefill chunks of one token), then the multi-token prefill chunks, shortest context first. New
K/V are written into their cache slots first. On a CPU (float32 or bfloat16) the decodes' rows and
those of chunks with under C_PREFILL_CONTEXT tokens of context then attend over their sequences'
blocks in place, in one call (kernels.attention_); longer chunks, and everything elsewhere, use
SDPA: the decodes together over a gathered copy of their blocks, each chunk over its own context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dynamo_pd.engines.native.kernels import attends_in_c, attention_, store_kv_

# Below this context a chunk's rows attend in the C kernel, at or above it with SDPA: one fresh chunk took
# 0.42 / 0.70 / 0.84 / 1.01 / 1.51x SDPA's time at 16 / 64 / 128 / 192 / 1024 tokens (the kernel takes a dot per
# token and head, SDPA blocks its arithmetic as a matmul does but costs ~100 us a call).
C_PREFILL_CONTEXT = 192


@dataclass
class PrefillChunk:
    start: int  # first row of the chunk in the flattened batch
    end: int
    context_len: int  # tokens in the cache once this chunk is written (end - start: a fresh prompt)


@dataclass
class AttentionBatch:
    slot_blocks: torch.Tensor  # [tokens] cache block of each new token
    slot_offsets: torch.Tensor  # [tokens] its place in that block
    num_decode: int
    block_tables: torch.Tensor  # [sequences, max_blocks]: the decodes', then each prefill chunk's; padded with 0
    row_seqs: torch.Tensor  # [tokens] each row's sequence (its row of block_tables)
    row_lens: torch.Tensor  # [tokens] tokens each row attends over, its own included (its position + 1)
    decode_width: int  # blocks of the longest decode's table
    prefills: list[PrefillChunk]


def causal_mask(chunk_len: int, context_len: int, device: torch.device) -> torch.Tensor:
    """Query i of a chunk that ends the context sees keys 0 .. context_len - chunk_len + i."""
    offset = context_len - chunk_len
    rows = torch.arange(chunk_len, device=device)[:, None] + offset
    return torch.arange(context_len, device=device)[None, :] <= rows


def paged_attention(
    q: torch.Tensor,  # [tokens, heads, head_dim]
    k: torch.Tensor,  # [tokens, kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], blocks strided (block-major cache)
    v_cache: torch.Tensor,
    batch: AttentionBatch,
) -> torch.Tensor:
    tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    store_kv_(k, v, k_cache, v_cache, batch.slot_blocks, batch.slot_offsets)
    out = q.new_empty(tokens, heads, head_dim)
    n, prefills, short = batch.num_decode, batch.prefills, 0
    if attends_in_c(q):
        # the decodes and the leading chunks under the cut (model_runner puts the shortest contexts first)
        short = next((i for i, c in enumerate(prefills) if c.context_len >= C_PREFILL_CONTEXT), len(prefills))
        m = prefills[short - 1].end if short else n
        if m:
            attention_(q[:m], k_cache, v_cache, batch.block_tables, batch.row_seqs[:m], batch.row_lens[:m], out[:m])
        n = 0  # the decodes are done

    if n:
        # One query per sequence: fold the query heads sharing a KV head into the query axis,
        # so no KV head is repeated. [n, kv_heads, group, d] against [n, kv_heads, L, d].
        # index_select: on CPU far faster than advanced indexing for whole-block gathers.
        blocks = batch.block_tables[:n, : batch.decode_width].reshape(-1)
        keys = k_cache.index_select(0, blocks).view(n, -1, kv_heads, head_dim).transpose(1, 2)
        values = v_cache.index_select(0, blocks).view(n, -1, kv_heads, head_dim).transpose(1, 2)
        queries = q[:n].view(n, kv_heads, group, head_dim)
        in_use = torch.arange(keys.shape[2], device=q.device)[None, :] < batch.row_lens[:n, None]
        attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=in_use.view(n, 1, 1, -1))
        out[:n] = attended.reshape(n, heads, head_dim)

    block_size = k_cache.shape[1]
    for i, chunk in enumerate(prefills[short:], start=short):
        rows = slice(chunk.start, chunk.end)
        queries = q[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, chunk, d]
        fresh = chunk.context_len == chunk.end - chunk.start
        if fresh:  # its own K/V are the whole context
            keys, values = k[rows], v[rows]
        else:
            table = batch.block_tables[batch.num_decode + i, : -(-chunk.context_len // block_size)]
            keys = k_cache.index_select(0, table).flatten(0, 1)[: chunk.context_len]
            values = v_cache.index_select(0, table).flatten(0, 1)[: chunk.context_len]
        keys = keys.transpose(0, 1).unsqueeze(0)
        values = values.transpose(0, 1).unsqueeze(0)
        attended = F.scaled_dot_product_attention(
            queries, keys, values, enable_gqa=True, is_causal=fresh,
            attn_mask=None if fresh else causal_mask(chunk.end - chunk.start, chunk.context_len, q.device),
        )
        out[rows] = attended[0].transpose(0, 1)
    return out.view(tokens, heads * head_dim)
