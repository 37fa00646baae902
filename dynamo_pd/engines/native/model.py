"""The Llama forward pass in plain PyTorch, over a flattened batch of tokens and a paged KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dynamo_pd.engines.native.attention import AttentionBatch, paged_attention
from dynamo_pd.engines.native.config import ModelConfig, rope_tables
from dynamo_pd.engines.native.loader import ModelWeights, linear


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, max_len: int, device: torch.device):
        self.cfg = cfg
        self.weights = weights
        self.cos, self.sin = rope_tables(cfg, max_len, device)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # Hugging Face's rotate-half convention: the two halves of head_dim form the pairs.
        x1, x2 = x.float().chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return rotated.to(x.dtype)

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
        cos = self.cos[positions].unsqueeze(1)  # [tokens, 1, head_dim // 2]
        sin = self.sin[positions].unsqueeze(1)
        eps = cfg.rms_norm_eps
        hidden = w.embed[input_ids]
        tokens = hidden.shape[0]
        for i, layer in enumerate(w.layers):
            x = F.rms_norm(hidden, (cfg.hidden_size,), layer.input_norm, eps)
            qkv = linear(x, layer.qkv, layer.qkv_bias)
            # q and k rotate together: one rope call for both.
            qk = self._rope(qkv[:, : q_size + kv_size].view(tokens, heads + kv_heads, head_dim), cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, q_size + kv_size:].view(tokens, kv_heads, head_dim)
            attn = paged_attention(q, k, v, kv_cache[i, 0], kv_cache[i, 1], batch)
            hidden = hidden + linear(attn, layer.o_proj)
            x = F.rms_norm(hidden, (cfg.hidden_size,), layer.post_norm, eps)
            gate, up = linear(x, layer.gate_up).chunk(2, dim=-1)
            hidden = hidden + linear(F.silu(gate) * up, layer.down)
        last = F.rms_norm(hidden[logit_rows], (cfg.hidden_size,), w.norm, eps)
        return linear(last, w.lm_head).float()
