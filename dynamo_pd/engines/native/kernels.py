"""The native engine's hot steps besides the matmuls: attention reading the paged cache in place, new K and V
into their slots, the residual add fused with RMS norm, rotary embedding in place, a grammar's token bitmask on
the logits. On a CPU in float32 or
bfloat16 they run in C (_kernels.c, built by the install), elsewhere as the same arithmetic in torch; where the C
is not built, the import warns once."""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

try:
    from dynamo_pd.engines.native import _kernels
except ImportError:
    _kernels = None
    logging.getLogger(__name__).warning(
        "dynamo_pd.engines.native._kernels is not built (no C compiler at install?): the native engine runs "
        "its CPU steps in torch (decode attention gathers each sequence's KV blocks into a copy; slower); "
        "reinstall with gcc and the Python headers to build it")


_DTYPES = (torch.float32, torch.bfloat16)


def in_c(x: torch.Tensor) -> bool:
    return _kernels is not None and x.device.type == "cpu" and x.dtype in _DTYPES


def attends_in_c(q: torch.Tensor) -> bool:
    """Whether attention_ runs for these queries ([tokens, heads, head_dim]): in_c, and a head_dim that is a
    multiple of the kernel's 16 lanes (every Llama-family model's)."""
    return in_c(q) and q.shape[-1] % 16 == 0


def _dense_rows(*tensors: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    # the C takes raw pointers: a layout it cannot read is a bug here, not something to compute wrong
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("the native engine's C kernels need contiguous tensors")
    if dtype is not None and any(t.dtype != dtype for t in tensors):
        raise ValueError(f"the native engine's C kernels need {dtype} here")


def _block_major(k_cache: torch.Tensor, v_cache: torch.Tensor, *indices: torch.Tensor) -> None:
    """The caches as model_runner allocates them ([blocks, block_size, kv_heads, head_dim], dense within a block,
    float32 or bfloat16) and int64 indices into them, or a ValueError."""
    _, _, kv_heads, dim = k_cache.shape
    if (k_cache.stride()[1:] != (kv_heads * dim, dim, 1) or v_cache.stride() != k_cache.stride()
            or k_cache.dtype not in _DTYPES or v_cache.dtype != k_cache.dtype
            or any(i.dtype != torch.long for i in indices)):
        raise ValueError("the native engine's C kernels need a block-major float32 or bfloat16 KV cache and int64 "
                         "indices")
    _dense_rows(*indices)


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """hidden += delta in place (none if None); returns RMS-normalized hidden times weight. [rows, dim]."""
    if not in_c(hidden):
        if delta is not None:
            hidden += delta
        return F.rms_norm(hidden, (hidden.shape[-1],), weight, eps)
    _dense_rows(hidden, weight, *(() if delta is None else (delta,)), dtype=hidden.dtype)
    out = torch.empty_like(hidden)
    _kernels.add_rms_norm(hidden.data_ptr(), 0 if delta is None else delta.data_ptr(), weight.data_ptr(),
                          out.data_ptr(), hidden.shape[0], hidden.shape[1], torch.get_num_threads(),
                          int(hidden.dtype == torch.bfloat16), eps)
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates x ([tokens, heads, head_dim], heads dense, rows strided) in place, Hugging Face's rotate-half
    convention (the two halves of head_dim form the pairs); cos and sin are each token's, [tokens, head_dim // 2]
    float32."""
    if not in_c(x):
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        x1, x2 = x.float().chunk(2, dim=-1)
        x.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))
        return
    tokens, heads, dim = x.shape
    if x.stride()[1:] != (dim, 1):
        raise ValueError("rope_ needs dense heads")
    _dense_rows(cos, sin, dtype=torch.float32)
    _kernels.rope(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), tokens, heads, dim,
                  torch.get_num_threads(), int(x.dtype == torch.bfloat16))


def store_kv_(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_blocks: torch.Tensor, slot_offsets: torch.Tensor) -> None:
    """Writes each token's K and V ([tokens, kv_heads, head_dim], heads dense) into its slot of the block-major
    cache ([blocks, block_size, kv_heads, head_dim])."""
    if not in_c(k):
        k_cache.index_put_((slot_blocks, slot_offsets), k)
        v_cache.index_put_((slot_blocks, slot_offsets), v)
        return
    tokens, kv_heads, dim = k.shape
    if k.stride()[1:] != (dim, 1) or v.stride()[1:] != (dim, 1):
        raise ValueError("store_kv_ needs dense heads")
    _block_major(k_cache, v_cache, slot_blocks, slot_offsets)
    if k.dtype != k_cache.dtype or v.dtype != k_cache.dtype:
        raise ValueError("store_kv_ needs K and V in the cache's dtype")
    _kernels.store(k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                   k_cache.stride(0), slot_blocks.data_ptr(), slot_offsets.data_ptr(), tokens, kv_heads * dim,
                   k.element_size())


def attention_(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
               row_seqs: torch.Tensor, lens: torch.Tensor, out: torch.Tensor) -> None:
    """Into out: each query row r ([tokens, heads, head_dim]) attends over the first lens[r] cached tokens of
    sequence row_seqs[r], found through tables[row_seqs[r]] (blocks of the block-major cache), read in place:
    decodes and prefill chunks alike, their new K and V stored first. C only (where attends_in_c): attention.py
    runs SDPA elsewhere. In bfloat16 the kernel takes the queries and gives its output in float32 (copies of the
    step's rows), and reads the cache as it is."""
    tokens, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if not attends_in_c(q) or q.dtype != k_cache.dtype:
        raise ValueError("attention_ needs float32 or bfloat16 queries in the cache's dtype, head_dim a "
                         "multiple of 16")
    _block_major(k_cache, v_cache, tables, row_seqs, lens)
    _dense_rows(out)
    bf16 = q.dtype == torch.bfloat16
    if bf16:
        q = q.float()
    elif q.stride()[1:] != (head_dim, 1):
        raise ValueError("attention in place needs dense head rows")
    result = out.new_empty(tokens, heads, head_dim, dtype=torch.float32) if bf16 else out
    _kernels.attention(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), int(bf16),
                       k_cache.stride(0), tables.data_ptr(), tables.shape[1], row_seqs.data_ptr(), lens.data_ptr(),
                       result.data_ptr(), tokens, kv_heads, heads // kv_heads, head_dim, block_size,
                       torch.get_num_threads(), 1 / math.sqrt(head_dim))
    if bf16:
        out.copy_(result)


def mask_logits_(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: in each of `rows` of logits ([rows, vocab] float32), every token whose bit is 0 in that row of
    bitmask (xgrammar's: int32 words, token t is bit t % 32 of word t // 32) becomes -inf. Elsewhere than a
    dense float32 CPU tensor, xgrammar's own kernel does it."""
    if not (in_c(logits) and logits.dtype == torch.float32 and logits.is_contiguous() and bitmask.is_contiguous()
            and bitmask.dtype == torch.int32 and bitmask.shape[1] * 32 >= logits.shape[1]):
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
        return
    indices = torch.tensor(rows, dtype=torch.long)
    _kernels.mask(logits.data_ptr(), logits.shape[1], bitmask.data_ptr(), bitmask.shape[1], indices.data_ptr(),
                  len(rows), torch.get_num_threads())
