"""The native engine's CPU kernels (engines/native/_kernels.c) give the torch path's results, in float32 and
bfloat16: attention read in place against gathered blocks and SDPA (scattered block tables, every length around
a block edge, grouped and plain heads, head sizes 32 to 128, any thread count; prefill rows, fresh or after a
cached context, beside decodes or alone, short chunks in the kernel and long ones with SDPA; a head size the
kernel's 16 lanes do not divide takes the torch path), the fused residual add and RMS norm against F.rms_norm,
rotary embedding bit for bit, and a grammar's token bitmask on the logits as xgrammar's own kernel applies it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import torch.nn.functional as F

from dynamo_pd.engines.native import attention, kernels
from dynamo_pd.engines.native.attention import AttentionBatch, PrefillChunk, paged_attention
from dynamo_pd.engines.native.kernels import add_rms_norm, mask_logits_, rope_

BLOCK = 16


@pytest.fixture
def torch_path(monkeypatch):
    """Runs a function on its torch path (as where the kernels are not built)."""
    def run(fn, *args):
        with monkeypatch.context() as m:
            m.setattr(kernels, "_kernels", None)
            return fn(*args)
    return run


def make_case(seed: int, lens: list[int], heads: int, kv_heads: int, head_dim: int,
              chunks: list[tuple[int, int]] = ()):
    """A block-major two-layer cache (as model_runner allocates it) with each sequence's blocks scattered, one new
    token per decode and, after the decodes, prefill chunks of (tokens, tokens already cached before them: 0 for a
    fresh prompt), the rows laid out as model_runner lays them out (give chunks shortest context first)."""
    gen = torch.Generator().manual_seed(seed)
    n = len(lens)
    tables_list, free = [], torch.randperm(400, generator=gen).tolist()
    for length in lens:
        tables_list.append([free.pop() for _ in range(-(-length // BLOCK))])
    cache = torch.randn(400, 2, 2, BLOCK, kv_heads, head_dim, generator=gen).permute(1, 2, 0, 3, 4, 5)
    tokens = n + sum(size for size, _ in chunks)
    qk = torch.randn(tokens, heads + kv_heads, head_dim, generator=gen)  # q is a strided view, as in the model
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    slot_blocks = [tables_list[i][(lens[i] - 1) // BLOCK] for i in range(n)]
    slot_offsets = [(length - 1) % BLOCK for length in lens]
    row_seqs, row_lens, prefills = list(range(n)), list(lens), []
    for size, cached in chunks:
        context, start = cached + size, len(row_seqs)
        table = [free.pop() for _ in range(-(-context // BLOCK))]
        slot_blocks += [table[p // BLOCK] for p in range(cached, context)]
        slot_offsets += [p % BLOCK for p in range(cached, context)]
        row_seqs += [len(tables_list)] * size
        row_lens += list(range(cached + 1, context + 1))
        tables_list.append(table)
        prefills.append(PrefillChunk(start=start, end=start + size, context_len=context))
    width = max(len(t) for t in tables_list)
    batch = AttentionBatch(slot_blocks=torch.tensor(slot_blocks), slot_offsets=torch.tensor(slot_offsets),
                           num_decode=n, block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables_list]),
                           row_seqs=torch.tensor(row_seqs), row_lens=torch.tensor(row_lens),
                           decode_width=max((len(t) for t in tables_list[:n]), default=0), prefills=prefills)
    return qk[:, :heads], k, v, cache[1, 0], cache[1, 1], batch


def test_the_install_built_the_kernels():
    """setup.py builds _kernels.c (optional: without a compiler the install goes on, with a warning)."""
    assert kernels._kernels is not None and kernels.in_c(torch.zeros(1))
    assert kernels.in_c(torch.zeros(1, dtype=torch.bfloat16)) and not kernels.in_c(torch.zeros(1, dtype=torch.half))


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 48), (2, 1, 128)])
def test_decode_in_place_equals_the_torch_path(heads, kv_heads, head_dim, torch_path):
    lens = [1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK, 3, 150, 77, 300]
    q, k, v, k_cache, v_cache, batch = make_case(heads * head_dim, lens, heads, kv_heads, head_dim)
    expected = torch_path(paged_attention, q, k, v, k_cache.clone(), v_cache.clone(), batch)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3, 64):  # 64: more threads than rows
            torch.set_num_threads(threads)
            got = paged_attention(q, k, v, k_cache, v_cache, batch)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)


def test_decode_in_place_with_scores_far_apart_equals_the_torch_path(torch_path):
    """Scores hundreds apart: the kernel's exp clamps below -87, where the torch path's weights are 0 or tiny."""
    q, k, v, k_cache, v_cache, batch = make_case(11, [1, 40, 200], 9, 3, 64)
    q = q * 400
    expected = torch_path(paged_attention, q, k, v, k_cache.clone(), v_cache.clone(), batch)
    torch.testing.assert_close(paged_attention(q, k, v, k_cache, v_cache, batch), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunks", [[(23, 0)], [(40, 37)], [(1, 300)], [(300, 0)],
                                    [(23, 0), (40, 37), (60, 200), (300, 0)]])
@pytest.mark.parametrize("decodes", [[], [40, 5, 17]])
def test_prefill_rows_attend_as_the_torch_path_does(chunks, decodes, torch_path, monkeypatch):
    """Fresh prompts and chunks after a cached context (chunked prefill, a prefix hit), alone, together or beside
    decodes: every row attends over its own position's prefix; the decodes' rows and those of chunks with under
    C_PREFILL_CONTEXT tokens of context in the kernel, in one call, the longer chunks with SDPA."""
    q, k, v, k_cache, v_cache, batch = make_case(7 + len(chunks) + chunks[0][1], decodes, 9, 3, 64, chunks)
    expected = torch_path(paged_attention, q, k, v, k_cache.clone(), v_cache.clone(), batch)
    calls = []
    monkeypatch.setattr(attention, "attention_", lambda q, *a: calls.append(len(q)) or kernels.attention_(q, *a))
    torch.testing.assert_close(paged_attention(q, k, v, k_cache, v_cache, batch), expected, rtol=1e-5, atol=1e-5)
    in_kernel = len(decodes) + sum(size for size, cached in chunks if size + cached < attention.C_PREFILL_CONTEXT)
    assert calls == ([in_kernel] if in_kernel else [])


def test_bfloat16_attention_reads_the_cache_as_it_is_and_equals_the_torch_path(torch_path):
    case = make_case(5, [1, BLOCK + 1, 150, 77], 9, 3, 64, [(9, 0)])
    q, k, v, k_cache, v_cache = (t.to(torch.bfloat16) for t in case[:5])
    theirs = k_cache.clone(), v_cache.clone()
    expected = torch_path(paged_attention, q, k, v, *theirs, case[5])
    got = paged_attention(q, k, v, k_cache, v_cache, case[5])
    assert got.dtype == torch.bfloat16
    assert torch.equal(k_cache, theirs[0]) and torch.equal(v_cache, theirs[1])  # the new K and V, stored alike
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)  # one bfloat16 rounding of the output apart


def test_a_head_size_the_lanes_do_not_divide_takes_the_torch_path(torch_path):
    q, k, v, k_cache, v_cache, batch = make_case(9, [3, 40, 100], 4, 2, 40)
    assert not kernels.attends_in_c(q)
    expected = torch_path(paged_attention, q, k, v, k_cache.clone(), v_cache.clone(), batch)
    torch.testing.assert_close(paged_attention(q, k, v, k_cache, v_cache, batch), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="multiple of 16"):
        kernels.attention_(q.contiguous(), k_cache, v_cache, batch.block_tables, batch.row_seqs, batch.row_lens,
                           torch.empty(3, 4, 40))


def test_a_layout_the_kernel_cannot_read_is_refused():
    q, k, v, k_cache, v_cache, batch = make_case(3, [20, 9], 9, 3, 64)
    batch.block_tables = batch.block_tables.int()
    with pytest.raises(ValueError, match="int64 indices"):
        paged_attention(q, k, v, k_cache, v_cache, batch)
    with pytest.raises(ValueError, match="contiguous"):
        add_rms_norm(torch.ones(4, 8).t(), None, torch.ones(4), 1e-5)


@pytest.mark.parametrize("rows,dim", [(1, 576), (7, 100), (300, 576)])  # 300 x 576: the threaded branch
@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_equals_adding_then_f_rms_norm(rows, dim, with_delta, dtype, torch_path):
    gen = torch.Generator().manual_seed(rows + dim)
    hidden, weight = (torch.randn(rows, dim, generator=gen) * 3).to(dtype), torch.randn(dim, generator=gen).to(dtype)
    delta = torch.randn(rows, dim, generator=gen).to(dtype) if with_delta else None
    theirs = hidden.clone()
    expected = torch_path(add_rms_norm, theirs, delta, weight, 1e-5)
    ours = hidden.clone()
    got = add_rms_norm(ours, delta, weight, 1e-5)
    assert got.dtype == dtype
    assert torch.equal(ours, theirs)  # the residual add, in place, exactly (in bfloat16: rounded alike)
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bfloat16: a last-bit rounding of the output apart at most
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    torch.testing.assert_close(got, F.rms_norm(theirs, (dim,), weight, 1e-5), rtol=tol, atol=tol)


@pytest.mark.parametrize("tokens", [1, 5, 700])  # 700: the threaded branch
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_is_bit_identical_to_the_torch_path(tokens, dtype, torch_path):
    gen = torch.Generator().manual_seed(tokens)
    heads, kv_heads, dim = 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    angles = torch.rand(tokens, dim // 2, generator=gen) * 100
    cos, sin = angles.cos(), angles.sin()
    views = []
    for _ in range(2):  # q and k as the model holds them: a strided view of the fused projection's rows
        copy = qkv.clone()
        views.append((copy, copy[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)))
    torch_path(rope_, views[0][1], cos, sin)
    rope_(views[1][1], cos, sin)
    assert torch.equal(views[1][0], views[0][0])
    assert not torch.equal(views[1][0], qkv)


@pytest.mark.parametrize("vocab", [49152, 49153, 50])
def test_a_token_bitmask_masks_the_rows_given_as_xgrammars_kernel_does(vocab, torch_path):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, words), dtype=torch.int32, generator=gen)
    bitmask[1] = 0  # nothing allowed but what the other words keep: whole words of zeros and of ones
    bitmask[3, : words // 2] = -1
    expected, got = logits.clone(), logits.clone()
    torch_path(mask_logits_, expected, bitmask, [1, 2, 3])
    mask_logits_(got, bitmask, [1, 2, 3])
    assert torch.equal(got, expected)
    assert torch.equal(got[[0, 4]], logits[[0, 4]])
    assert torch.isinf(got[1]).all() and torch.isfinite(got[3, : words // 2 * 32]).all()


def test_without_the_kernels_the_engine_says_so_and_works():
    code = ("import sys; sys.modules['dynamo_pd.engines.native._kernels'] = None\n"  # as if no compiler
            "import torch; from dynamo_pd.engines.native import kernels\n"
            "assert not kernels.in_c(torch.zeros(1))\n"
            "x = torch.ones(2, 4); out = kernels.add_rms_norm(x, torch.ones(2, 4), torch.ones(4), 1e-6)\n"
            "assert torch.allclose(out, torch.ones(2, 4)) and torch.equal(x, torch.full((2, 4), 2.0))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "_kernels is not built" in done.stderr and "gathers each sequence's KV blocks" in done.stderr
