"""Attention over the paged KV cache.

A step's tokens are flattened into one batch: first every single-token query (decodes, and
prefill chunks of one token), then the multi-token prefill chunks. New K/V are written into
their cache slots; decodes then attend together over their gathered blocks, and each prefill
chunk attends over its own context. On a CPU (float32 or bfloat16) the decodes read their blocks in
place (kernels.decode_attention_); elsewhere they attend over a gathered copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dynamo_pd.engines.native.kernels import decode_attention_, decodes_in_c, store_kv_


@dataclass
class PrefillChunk:
    start: int  # first row of the chunk in the flattened batch
    end: int
    block_table: torch.Tensor  # blocks covering the context, [num_blocks]
    context_len: int  # tokens in the cache once this chunk is written
    mask: torch.Tensor | None  # [chunk, context_len] bool; None: the chunk is the whole context


@dataclass
class AttentionBatch:
    slot_blocks: torch.Tensor  # [tokens] cache block of each new token
    slot_offsets: torch.Tensor  # [tokens] its place in that block
    num_decode: int
    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks], padded with block 0
    decode_lens: torch.Tensor | None  # [num_decode] tokens each decode attends over, its new one included
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

    n = batch.num_decode
    if n and decodes_in_c(q):
        decode_attention_(q[:n], k_cache, v_cache, batch.decode_block_tables, batch.decode_lens, out)
    elif n:
        # One query per sequence: fold the query heads sharing a KV head into the query axis,
        # so no KV head is repeated. [n, kv_heads, group, d] against [n, kv_heads, L, d].
        # index_select: on CPU far faster than advanced indexing for whole-block gathers.
        blocks = batch.decode_block_tables.view(-1)
        keys = k_cache.index_select(0, blocks).view(n, -1, kv_heads, head_dim).transpose(1, 2)
        values = v_cache.index_select(0, blocks).view(n, -1, kv_heads, head_dim).transpose(1, 2)
        queries = q[:n].view(n, kv_heads, group, head_dim)
        in_use = torch.arange(keys.shape[2], device=q.device)[None, :] < batch.decode_lens[:, None]
        attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=in_use.view(n, 1, 1, -1))
        out[:n] = attended.reshape(n, heads, head_dim)

    for chunk in batch.prefills:
        rows = slice(chunk.start, chunk.end)
        queries = q[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, chunk, d]
        if chunk.mask is None:  # fresh prompt: its own K/V are the whole context
            keys, values = k[rows], v[rows]
        else:
            keys = k_cache.index_select(0, chunk.block_table).flatten(0, 1)[: chunk.context_len]
            values = v_cache.index_select(0, chunk.block_table).flatten(0, 1)[: chunk.context_len]
        keys = keys.transpose(0, 1).unsqueeze(0)
        values = values.transpose(0, 1).unsqueeze(0)
        attended = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=chunk.mask, is_causal=chunk.mask is None, enable_gqa=True
        )
        out[rows] = attended[0].transpose(0, 1)
    return out.view(tokens, heads * head_dim)
