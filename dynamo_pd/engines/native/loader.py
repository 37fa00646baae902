"""Load Llama-family safetensors into fused, inference-ready tensors."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from dynamo_pd.engines.native.config import ModelConfig


def packs_weights(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether projection weights are stored in oneDNN's blocked layout (`pack`, `linear`): on a CPU, float32, and
    bfloat16 where the CPU has bfloat16 instructions (AVX512-BF16: a step's projections 1.3 / 1.55 / 1.3x faster at
    1 / 8 / 32 rows than plain, the same output; without them oneDNN has no bfloat16 kernel worth it)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.cpu._is_avx512_bf16_supported())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` ([out, in]) reordered for oneDNN's inner product; the plain one can be dropped. Blocked for
    32 rows (the layout, not a limit): over a step's 30 layers it measured 40 / 42 / 80 ms at 1 / 8 / 32 rows
    against PyTorch's MKL matmul's 68 / 160 / 184 (2-core AVX2 host, weights streamed from memory)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 32)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a plain weight or a `pack`ed one (dense input and output)."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    # the projections are plain or `pack`ed (packs_weights); the model multiplies them with `linear`
    qkv: torch.Tensor  # q, k and v projections stacked: one matmul instead of three
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # gate and up projections stacked
    down: torch.Tensor


@dataclass
class ModelWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor


def load_weights(model_dir: Path, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> ModelWeights:
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                # a copy, not a view of the mapped file: one view kept (the embedding) would keep the whole
                # mapping, packed weights' pages included, resident beside the packed copies (+280 MB RSS)
                tensors[name] = f.get_tensor(name).clone()

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise KeyError(f"weight {name!r} missing from {model_dir}")
        return tensors.pop(name).to(device=device, dtype=dtype)

    def packed(weight: torch.Tensor) -> torch.Tensor:
        return pack(weight) if packing else weight

    def cat(*names: str) -> torch.Tensor:
        return torch.cat([take(n) for n in names]).contiguous()

    packing = packs_weights(device, dtype)
    # Tied checkpoints store either copy (model_store's converter keeps lm_head.weight).
    embed = tensors.pop("model.embed_tokens.weight", None)
    head = tensors.pop("lm_head.weight", None)
    if cfg.tie_word_embeddings:
        embed = head = embed if embed is not None else head
    if embed is None or head is None:
        raise KeyError(f"embedding or lm_head weight missing from {model_dir}")
    embed = embed.to(device=device, dtype=dtype)
    # A tied head is packed too, beside the plain matrix the embedding lookup needs: the twin costs its size
    # (113 MB for SmolLM2) but the head is a fifth of the weights, and plain it took 12 / 32 / 38 ms a step at
    # 1 / 8 / 32 rows against 8 / 11 / 18 packed (2-core AVX2 host).
    lm_head = packed(head.to(device=device, dtype=dtype))

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        layers.append(LayerWeights(
            input_norm=take(p + "input_layernorm.weight"),
            qkv=packed(cat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight")),
            qkv_bias=cat(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias") if cfg.attention_bias else None,
            o_proj=packed(take(a + "o_proj.weight")),
            post_norm=take(p + "post_attention_layernorm.weight"),
            gate_up=packed(cat(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")),
            down=packed(take(p + "mlp.down_proj.weight")),
        ))
    return ModelWeights(embed=embed, layers=layers, norm=take("model.norm.weight"), lm_head=lm_head)
