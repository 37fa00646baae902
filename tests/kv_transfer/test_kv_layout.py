"""Layouts, region math and converters, against the logical [L, 2, B, T, H, D] view."""

import numpy as np
import pytest
import torch
from kv_peer import filled_memory, make_layout, token_stream

from kv_transfer import ENGINE_LAYOUTS, KVLayout, KVMemory, copy_tokens
from kv_transfer.layout import block_regions, paired_regions


def test_native_layout_from_engine_tensor():
    kv_cache = torch.zeros(30, 2, 12, 16, 3, 64)  # SmolLM2-135M, 12 blocks of 16 tokens
    memory = KVMemory.native(kv_cache, "SmolLM2-135M")
    layout = memory.layout
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size, layout.num_blocks) == (
        30, 3, 64, 16, 12)
    assert layout.order == "LKBTHD" and layout.dtype == "float32" and not layout.buffer_per_layer
    assert layout.block_bytes == 30 * 2 * 16 * 3 * 64 * 4
    kv_cache[4, 1, 7, 3, 2] = 5.0  # layer 4, V, block 7, token 3, head 2: seen through the logical view
    assert memory.layer_view(4)[1, 7, 3, 2].eq(5.0).all()


def test_the_native_engines_block_major_cache_is_one_region_per_block():
    from types import SimpleNamespace

    from dynamo_pd.engines.native.model_runner import allocate_kv_cache

    smollm2 = SimpleNamespace(cfg=SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64))  # all it reads
    kv_cache = allocate_kv_cache(smollm2, 12, 16, torch.float32, torch.device("cpu"))
    assert kv_cache.shape == (30, 2, 12, 16, 3, 64)
    memory = KVMemory.native(kv_cache, "SmolLM2-135M")
    assert memory.layout.order == ENGINE_LAYOUTS["native"][0] == "BLKTHD"
    assert memory.buffers[0].data_ptr() == kv_cache.data_ptr()  # the engine's memory itself, no copy
    kv_cache[4, 1, 7, 3, 2] = 5.0
    assert memory.layer_view(4)[1, 7, 3, 2].eq(5.0).all()
    rows = block_regions(memory.layout, np.array([9, 2, 5, 0]))  # scattered: one region a block, whole
    assert rows[:, 2].tolist() == [memory.layout.block_bytes] * 4
    with pytest.raises(ValueError, match="no permutation of a contiguous tensor"):
        KVMemory.native(torch.zeros(30, 2, 24, 16, 3, 64)[:, :, ::2], "SmolLM2-135M")


def test_a_host_kv_pool_is_zeroed_resident_and_on_huge_pages_where_the_kernel_has_them():
    from pathlib import Path

    from kv_transfer.memory import kv_zeros

    pool = kv_zeros((16, 1024, 1024), torch.float32)  # 64 MiB
    assert pool.shape == (16, 1024, 1024) and pool.is_contiguous() and not pool.any()
    pool[3, 5, 7] = 1.0
    assert pool.sum() == 1.0
    start = pool.data_ptr()
    maps = Path("/proc/self/smaps").read_text().split("\n")
    at = next(i for i, line in enumerate(maps) if "-" in line.split(" ")[0] and
              int(line.split("-")[0], 16) <= start < int(line.split(" ")[0].split("-")[1], 16))
    fields = {}
    for line in maps[at + 1:]:
        if not line.endswith("kB"):
            break
        fields[line.split(":")[0]] = int(line.split()[1])
    assert fields["Rss"] >= 64 * 1024  # every page touched at allocation: the cache is reserved
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text():
        assert fields["AnonHugePages"] > 0
    with pytest.raises(RuntimeError, match=r"can't allocate memory: the KV pool needs 100000.00 GiB"):
        kv_zeros((100000, 1024, 1024, 256), torch.float32)


@pytest.mark.parametrize("engine", sorted(ENGINE_LAYOUTS))
def test_regions_of_any_blocks_hold_exactly_those_blocks(engine):
    layout = make_layout(engine, block_size=8)
    memory = filled_memory(layout, seed=1)
    ids = [9, 10, 11, 3, 40, 41, 0]
    staging = KVMemory.allocate(layout.with_blocks(len(ids)))
    src_rows, dst_rows = paired_regions(layout, ids, staging.layout, np.arange(len(ids)))
    for (sb, so, n), (db, do, _) in zip(src_rows.tolist(), dst_rows.tolist()):
        staging.region(db, do, n).copy_(memory.region(sb, so, n))
    for layer in range(layout.num_layers):
        assert torch.equal(staging.layer_view(layer), memory.layer_view(layer)[:, ids])
    # gather packs the same bytes in the same (stream) order; scatter puts them back
    packed = memory.gather(ids, torch.empty(len(ids) * layout.block_bytes, dtype=torch.uint8))
    assert torch.equal(packed, torch.cat([memory.region(*row) for row in src_rows.tolist()]))
    other = KVMemory.allocate(layout)
    other.scatter(ids, packed)
    assert torch.equal(other.gather(ids, torch.empty_like(packed)), packed)
    # runs of consecutive blocks merge: 4 runs per outer combination
    assert len(block_regions(layout, np.array(ids))) == 4 * len(layout.outer_offsets())
    assert int(src_rows[:, 2].sum()) == len(ids) * layout.block_bytes


def test_region_rows_reject_out_of_range_blocks():
    layout = make_layout("native", 16)
    with pytest.raises(ValueError, match="block id out of range"):
        block_regions(layout, np.array([3, layout.num_blocks]))


@pytest.mark.parametrize("src_engine,dst_engine", [
    ("native", "vllm"), ("vllm", "trtllm"), ("trtllm", "vllm-flashinfer"), ("vllm-flash-hnd", "native"),
])
@pytest.mark.parametrize("src_bs,dst_bs", [(16, 16), (16, 8), (8, 32), (16, 4)])
def test_copy_tokens_converts_order_and_block_size(src_engine, dst_engine, src_bs, dst_bs):
    src = filled_memory(make_layout(src_engine, src_bs), seed=2)
    dst = KVMemory.allocate(make_layout(dst_engine, dst_bs))
    src_blocks = [17, 3, 4, 5, 60, 2, 33, 34]
    skip, count = 8, len(src_blocks) * src_bs - 8 - 3  # start mid-block, end on a partial block
    dst_blocks = list(range(50, 50 - -(-count // dst_bs), -1))
    copy_tokens(src, src_blocks, dst, dst_blocks, skip, count)
    expected = token_stream(src, src_blocks, skip + count)[:, :, skip:]
    assert torch.equal(token_stream(dst, dst_blocks, count), expected)


def test_heads_split_for_tensor_parallel_and_merged_back():
    full = filled_memory(make_layout("native", 16), seed=3)
    blocks = [5, 6, 9]
    ranks = [KVMemory.allocate(make_layout("vllm", 16, num_kv_heads=2, head_offset=2 * r)) for r in range(2)]
    for rank in ranks:
        copy_tokens(full, blocks, rank, [0, 1, 2], 0, 48)
    expected = token_stream(full, blocks, 48)
    for r, rank in enumerate(ranks):
        assert torch.equal(token_stream(rank, [0, 1, 2], 48), expected[:, :, :, 2 * r : 2 * r + 2])
    merged = KVMemory.allocate(make_layout("trtllm", 8))
    for rank in ranks:  # one call per source rank, each fills its heads
        copy_tokens(rank, [0, 1, 2], merged, list(range(6)), 0, 48)
    assert torch.equal(token_stream(merged, list(range(6)), 48), expected)


def test_compat_hash_covers_what_cannot_be_converted():
    base = make_layout("native", 16)
    assert base.compat_hash() == make_layout("vllm", 8).compat_hash()
    assert base.compat_hash() == make_layout("trtllm", 32, num_kv_heads=2, head_offset=2).compat_hash()
    for other in (make_layout("native", 16, model="other"),
                  KVLayout("smol", 4, 4, 16, 16, 64, "bfloat16"),
                  KVLayout("smol", 5, 4, 16, 16, 64, "float32"),
                  KVLayout("smol", 4, 4, 32, 16, 64, "float32"),
                  KVLayout("smol", 4, 8, 16, 16, 64, "float32")):
        assert other.compat_hash() != base.compat_hash()
        assert "incompatible" in base.convertible(other)
    left = make_layout("native", 16, num_kv_heads=2, head_offset=0)
    right = make_layout("native", 16, num_kv_heads=2, head_offset=2)
    assert "no KV heads in common" in left.convertible(right)


@pytest.mark.parametrize("fields,message", [
    (dict(order="LKBTHX"), "permutation"),
    (dict(order="KLBTHD", buffer_per_layer=True), "L outermost"),
    (dict(dtype="int7"), "dtype"),
    (dict(block_size=0), "block_size must be positive"),
    (dict(num_kv_heads=3, head_offset=2, total_kv_heads=4), "outside total_kv_heads"),
])
def test_bad_layouts_are_refused_by_name(fields, message):
    args = dict(model="m", num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, num_blocks=4, dtype="float32")
    with pytest.raises(ValueError, match=message):
        KVLayout(**{**args, **fields})


def test_memory_must_match_its_layout():
    layout = make_layout("vllm", 16)
    with pytest.raises(ValueError, match="needs 4 buffers"):
        KVMemory(layout, [torch.zeros(layout.buffer_shape)])
    with pytest.raises(ValueError, match="bytes"):
        KVMemory(layout, [torch.zeros(3) for _ in range(4)])
    with pytest.raises(ValueError, match="dtype"):
        KVMemory(layout, [torch.zeros(layout.buffer_shape, dtype=torch.float16) for _ in range(4)])
    with pytest.raises(ValueError, match="unknown engine layout"):
        KVLayout.for_engine("mystery", model="m")


def test_buffer_pool_reuses_the_smallest_fitting_buffer_and_stays_bounded():
    from kv_transfer.memory import BufferPool

    pool = BufferPool(keep=2)
    small, big = pool.take(100), pool.take(1000)
    assert small.numel() == 100 and big.numel() == 1000
    pool.give(big)
    pool.give(small)
    assert pool.take(50) is small and pool.take(500) is big
    pool.give(pool.take(10))
    for buffer in (torch.empty(1, dtype=torch.uint8), small, big):
        pool.give(buffer)
    assert pool.take(1) is small and pool.take(1) is big  # the 1- and 10-byte buffers were dropped
    assert pool.take(1).numel() == 1  # nothing idle: a fresh one
