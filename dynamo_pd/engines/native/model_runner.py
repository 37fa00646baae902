"""Turns a scheduled batch into model inputs and runs the forward pass over the paged KV cache."""

from __future__ import annotations

import torch

from dynamo_pd.engines.native.attention import AttentionBatch, PrefillChunk
from dynamo_pd.engines.native.model import LlamaModel
from dynamo_pd.engines.native.scheduler import ScheduledBatch
from dynamo_pd.engines.native.sequence import Sequence
from kv_transfer.memory import kv_zeros

PromptScores = list[tuple[Sequence, torch.Tensor]]  # a sequence's logits scoring its next prompt tokens


def allocate_kv_cache(model: LlamaModel, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """The cache indexed [layers, 2 (K, V), blocks, block_size, kv_heads, head_dim], block-major in memory
    ([blocks, layers, 2, ...]): a block's KV is one region, so scattered blocks transfer without packing."""
    cfg = model.cfg
    shape = (num_blocks, cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim)
    return kv_zeros(shape, dtype, device).permute(1, 2, 0, 3, 4, 5)


def kv_bytes_per_block(model: LlamaModel, block_size: int, dtype: torch.dtype) -> int:
    cfg = model.cfg
    itemsize = torch.empty((), dtype=dtype).element_size()
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * itemsize


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, block_size: int, device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device

    def _tensor(self, data: list) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.long, device=self.device)

    def run(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor, PromptScores]:
        """Compute the batch; return the sequences that reach their last token and their logits, and the
        logits that score the prompt tokens of sequences asking their logprobs (Sequence.scores_prompt)."""
        bs = self.block_size
        decodes = [seq for seq, n in batch if n == 1]
        # shortest context first: attention.py gives the short chunks' rows to the C kernel, in one call
        chunks = sorted(((seq, n) for seq, n in batch if n > 1), key=lambda c: c[0].num_computed_tokens + c[1])
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows_to_sample: list[int] = []
        seqs_to_sample: list[Sequence] = []
        scored: list[tuple[Sequence, int, int]] = []  # (sequence, its first row scoring a prompt token, rows)

        def score(seq: Sequence, row: int, start: int, end: int) -> None:
            # position p's logits score prompt token p + 1: those of the chunk not scored yet
            last = min(end, seq.num_prompt_tokens - 1)
            if seq.scores_prompt and len(seq.prompt_logprobs) == start + 1 and last > start:
                scored.append((seq, row, last - start))

        for row, seq in enumerate(decodes):
            pos = seq.num_computed_tokens
            input_ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(seq.block_table[pos // bs] * bs + pos % bs)
            score(seq, row, pos, pos + 1)
            if pos + 1 == len(seq.token_ids):
                rows_to_sample.append(row)
                seqs_to_sample.append(seq)
        tables = [seq.block_table for seq in decodes]
        row_seqs = list(range(len(decodes)))

        prefills = []
        for seq, n in chunks:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            table = seq.block_table
            row = len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            row_seqs.extend([len(tables)] * n)
            tables.append(table[: -(-end // bs)])
            prefills.append(PrefillChunk(start=row, end=row + n, context_len=end))
            score(seq, row, start, end)
            if end == len(seq.token_ids):
                rows_to_sample.append(row + n - 1)
                seqs_to_sample.append(seq)

        width = max(len(t) for t in tables)
        slots_t, positions_t = self._tensor(slots), self._tensor(positions)
        attn = AttentionBatch(
            slot_blocks=slots_t // bs,
            slot_offsets=slots_t % bs,
            num_decode=len(decodes),
            block_tables=self._tensor([t + [0] * (width - len(t)) for t in tables]),
            row_seqs=self._tensor(row_seqs),
            row_lens=positions_t + 1,
            decode_width=max((len(seq.block_table) for seq in decodes), default=0),
            prefills=prefills,
        )
        prompt_rows = [r for _, first, count in scored for r in range(first, first + count)]
        logits = self.model.forward(
            self._tensor(input_ids), positions_t, attn, self.kv_cache, self._tensor(rows_to_sample + prompt_rows)
        )
        sampled, rest = logits[:len(rows_to_sample)], logits[len(rows_to_sample):]
        return seqs_to_sample, sampled, [(seq, part) for (seq, _, _), part in
                                         zip(scored, rest.split([count for *_, count in scored]))]
