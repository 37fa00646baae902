"""The Llama forward pass in plain PyTorch, over a flattened batch of tokens and a paged KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dynamo_pd.engines.native.attention import AttentionBatch, paged_attention
from dynamo_pd.engines.native.config import ModelConfig, rope_tables
from dynamo_pd.engines.native.kernels import add_rms_norm, rope_
from dynamo_pd.engines.native.loader import ModelWeights, linear


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, max_len: int, device: torch.device):
        self.cfg = cfg
        self.weights = weights
        self.cos, self.sin = rope_tables(cfg, max_len, device)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [tokens]
        positions: torch.Tensor,  # [tokens]
        batch: AttentionBatch,
        kv_cache: torch.Tensor,  # [layers, 2, blocks, block_size, kv_heads, head_dim]
        logit_rows: torch.Tensor,  # rows whose next-token logits are wanted
    ) -> torch.Tensor:
        cfg, w = self.cfg, self.weights
        heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        cos, sin = self.cos[positions], self.sin[positions]  # [tokens, head_dim // 2]
        eps = cfg.rms_norm_eps
        hidden = w.embed[input_ids]  # a copy: the residual stream is added to in place
        tokens = hidden.shape[0]
        delta = None  # what the last sublayer adds to the residual stream, added by the next norm
        for i, layer in enumerate(w.layers):
            x = add_rms_norm(hidden, delta, layer.input_norm, eps)
            qkv = linear(x, layer.qkv, layer.qkv_bias)
            # q and k rotate together, in place: one call for both.
            qk = qkv[:, : q_size + kv_size].view(tokens, heads + kv_heads, head_dim)
            rope_(qk, cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, q_size + kv_size:].view(tokens, kv_heads, head_dim)
            attn = paged_attention(q, k, v, kv_cache[i, 0], kv_cache[i, 1], batch)
            if i == len(w.layers) - 1:  # past the last K/V only the sampled rows matter (a prompt's last)
                attn, hidden = attn[logit_rows], hidden[logit_rows]
            x = add_rms_norm(hidden, linear(attn, layer.o_proj), layer.post_norm, eps)
            gate, up = linear(x, layer.gate_up).chunk(2, dim=-1)
            delta = linear(F.silu(gate) * up, layer.down)
        return linear(add_rms_norm(hidden, delta, w.norm, eps), w.lm_head).float()
