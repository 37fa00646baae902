"""The Llama forward pass in plain PyTorch, over a flattened batch of tokens and a paged KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dynamo_pd.engines.native.attention import AttentionBatch, paged_attention
from dynamo_pd.engines.native.config import ModelConfig, rope_tables
from dynamo_pd.engines.native.loader import ModelWeights


_PACKED_MAX_ROWS = 4  # decode of a few sequences: memory-bound, where packed weights pay off


def _can_pack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkl.is_available()


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, max_len: int, device: torch.device):
        self.cfg = cfg
        self.weights = weights
        self.cos, self.sin = rope_tables(cfg, max_len, device)
        # CPU float32: an MKL-packed copy of each matrix makes few-row steps ~30% faster (one more
        # copy of the weights in memory); bigger batches are compute-bound and use the plain ones.
        self._packed: dict[int, torch.Tensor] = {}
        if _can_pack(weights.lm_head):
            for layer in weights.layers:
                for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
                    self._packed[id(w)] = torch.ops.mkl._mkl_reorder_linear_weight(w, 1)
            self._packed[id(weights.lm_head)] = torch.ops.mkl._mkl_reorder_linear_weight(weights.lm_head, 1)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        packed = self._packed.get(id(weight)) if x.shape[0] <= _PACKED_MAX_ROWS else None
        if packed is None:
            return F.linear(x, weight, bias)
        return torch.ops.mkl._mkl_linear(x, packed, weight, bias, 1)

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
            qkv = self._linear(x, layer.qkv, layer.qkv_bias)
            # q and k rotate together: one rope call for both.
            qk = self._rope(qkv[:, : q_size + kv_size].view(tokens, heads + kv_heads, head_dim), cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, q_size + kv_size:].view(tokens, kv_heads, head_dim)
            attn = paged_attention(q, k, v, kv_cache[i, 0], kv_cache[i, 1], batch)
            hidden = hidden + self._linear(attn, layer.o_proj)
            x = F.rms_norm(hidden, (cfg.hidden_size,), layer.post_norm, eps)
            gate, up = self._linear(x, layer.gate_up).chunk(2, dim=-1)
            hidden = hidden + self._linear(F.silu(gate) * up, layer.down)
        last = F.rms_norm(hidden[logit_rows], (cfg.hidden_size,), w.norm, eps)
        return self._linear(last, w.lm_head).float()
