"""Step times of the mocker: a performance profile, and the default one derived from first principles.

A profile holds two tables, interpolated (and extrapolated) piecewise-linearly on each axis:
  prefill_ms[i][j]: one forward pass computing prefill_tokens[i] new tokens of a prompt whose first
                    prefill_cached[j] tokens are already in the KV cache;
  decode_ms[i][j]:  one decode step of decode_batch[i] sequences with decode_context[j] tokens of KV each;
and the model's KV bytes per token with the prefill -> decode link's bandwidth, for hand-off times (and
peer pulls), and the KV tiers' bandwidths back to the GPU: host RAM over PCIe, disk (`onboard_s`).
A measured profile (same fields, JSON) replaces the default with `--profile PATH`.

The default, `h100_llama8b()`, is Llama-3.1-8B in bf16 on one H100 SXM, from the roofline
    time = max(FLOPs / (989 TFLOPS x 0.6), bytes / (3.35 TB/s x 0.8)) + 1 ms
989 TFLOPS is the H100 SXM's dense bf16 peak and 3.35 TB/s its HBM3 bandwidth (NVIDIA's datasheet);
0.6 and 0.8 are the fractions large GEMMs and streaming reads typically reach, and 1 ms stands for a
step's scheduling and launch overhead: assumptions, not measurements. A forward pass over T new
tokens costs 2 FLOPs per weight per token (2 x 6.98 G without embeddings and head; the 0.53 G-weight
LM head runs only on rows that sample), plus 4 x layers x heads x head_dim FLOPs per (query, key)
pair of attention; it reads every weight once (15.0 GB) and the KV of every token it attends to
(128 KiB per token), and writes its new tokens' KV. So a decode step of 1 sequence is memory-bound
at ~6.6 ms, of 64 sequences at 1k context ~9.8 ms, and prefilling 1k tokens is compute-bound at ~26 ms.
The link is one 400 Gb/s NIC per GPU (as in a DGX H100) at 80%: 40 GB/s. The host tier copies back over
the GPU's PCIe 5.0 x16 link (64 GB/s a direction) at 80%: 51 GB/s; the disk tier reads one local PCIe 4.0
NVMe drive (about 7 GB/s sequential) at 80%: 5.6 GB/s. Assumptions too, from the parts' datasheets.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path

import msgspec

from router.events import TIER_HOST


class Profile(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    source: str  # where the figures come from
    prefill_tokens: list[int]
    prefill_cached: list[int]
    prefill_ms: list[list[float]]  # [len(prefill_tokens)][len(prefill_cached)]
    decode_batch: list[int]
    decode_context: list[int]
    decode_ms: list[list[float]]  # [len(decode_batch)][len(decode_context)]
    kv_bytes_per_token: int  # of the profiled model: KV capacity and hand-off sizes
    transfer_gb_per_s: float  # prefill -> decode KV bandwidth (and a peer pull's)
    host_gb_per_s: float = 51.2  # host tier -> GPU (absent from older profiles: the default's figures)
    disk_gb_per_s: float = 5.6  # disk tier -> GPU

    def __post_init__(self) -> None:
        for axes, table in (((self.prefill_tokens, self.prefill_cached), self.prefill_ms),
                            ((self.decode_batch, self.decode_context), self.decode_ms)):
            if any(len(axis) < 2 or axis != sorted(set(axis)) for axis in axes):
                raise ValueError(f"profile {self.name!r}: table axes need >= 2 increasing points")
            if len(table) != len(axes[0]) or any(len(row) != len(axes[1]) for row in table):
                raise ValueError(f"profile {self.name!r}: a table's shape does not match its axes")
        if min(self.kv_bytes_per_token, self.transfer_gb_per_s, self.host_gb_per_s, self.disk_gb_per_s) <= 0:
            raise ValueError(f"profile {self.name!r}: kv_bytes_per_token and the bandwidths must be positive")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return msgspec.json.decode(Path(path).read_bytes(), type=cls)

    def prefill_time_ms(self, new_tokens: float, cached_tokens: float) -> float:
        return _bilinear(self.prefill_tokens, self.prefill_cached, self.prefill_ms, new_tokens, cached_tokens)

    def decode_time_ms(self, batch: float, context: float) -> float:
        return _bilinear(self.decode_batch, self.decode_context, self.decode_ms, batch, context)

    def step_ms(self, batch: list[tuple[int, int]]) -> float:
        """One scheduled batch of (new tokens, tokens already in the KV cache) per sequence. A step
        with a prefill chunk is compute-bound: its decode rows count as new tokens of the pass, at the
        chunks' token-weighted cached length; a decode-only step is looked up by batch and mean context."""
        chunks = [(n, c) for n, c in batch if n > 1]
        if not chunks:
            return self.decode_time_ms(len(batch), sum(c for _, c in batch) / len(batch))
        new = sum(n for n, _ in chunks)
        return self.prefill_time_ms(new + len(batch) - len(chunks), sum(n * c for n, c in chunks) / new)

    def transfer_s(self, num_tokens: int) -> float:
        return num_tokens * self.kv_bytes_per_token / (self.transfer_gb_per_s * 1e9)

    def onboard_s(self, tier: str, num_tokens: int) -> float:
        """Copying `num_tokens` tokens' KV back to the GPU from a lower tier (router.events' CPU or DISK)."""
        rate = self.host_gb_per_s if tier == TIER_HOST else self.disk_gb_per_s
        return num_tokens * self.kv_bytes_per_token / (rate * 1e9)


def _segment(axis: list[int], x: float) -> tuple[int, float]:
    """(i, t): x = axis[i] + t * (axis[i+1] - axis[i]); t outside [0, 1] extrapolates the end segment."""
    i = min(max(bisect.bisect_right(axis, x) - 1, 0), len(axis) - 2)
    return i, (x - axis[i]) / (axis[i + 1] - axis[i])


def _bilinear(xs: list[int], ys: list[int], table: list[list[float]], x: float, y: float) -> float:
    i, tx = _segment(xs, x)
    j, ty = _segment(ys, y)
    row = [table[i][j] + ty * (table[i][j + 1] - table[i][j]) for i in (i, i + 1)]
    return max(0.0, row[0] + tx * (row[1] - row[0]))


@dataclass(frozen=True)
class ModelShape:
    num_layers: int = 32  # Llama-3.1-8B
    hidden: int = 4096
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    vocab: int = 128256
    dtype_bytes: int = 2  # bf16

    @property
    def layer_weights(self) -> int:  # q, k, v, o projections and the gated MLP
        q_o = 2 * self.hidden * self.num_heads * self.head_dim
        k_v = 2 * self.hidden * self.num_kv_heads * self.head_dim
        return q_o + k_v + 3 * self.hidden * self.intermediate

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class Gpu:
    tflops: float = 989.0  # H100 SXM, dense bf16
    tb_per_s: float = 3.35  # H100 SXM, HBM3
    compute_efficiency: float = 0.6
    memory_efficiency: float = 0.8
    step_overhead_ms: float = 1.0
    link_gb_per_s: float = 40.0  # one 400 Gb/s NIC at 80%
    host_gb_per_s: float = 51.2  # PCIe 5.0 x16 at 80%
    disk_gb_per_s: float = 5.6  # one PCIe 4.0 NVMe drive at 80%


def roofline_ms(m: ModelShape, gpu: Gpu, new_tokens: float, logit_rows: float, attended: float,
                kv_tokens_read: float) -> float:
    """One forward pass: `attended` (query, key) pairs of attention, `kv_tokens_read` tokens of KV read."""
    linear = m.num_layers * m.layer_weights
    head = m.hidden * m.vocab
    attention = 4 * m.num_layers * m.num_heads * m.head_dim  # FLOPs per (query, key) pair: QK^T and PV
    flops = 2 * linear * new_tokens + 2 * head * logit_rows + attention * attended
    memory = (linear + head) * m.dtype_bytes + m.kv_bytes_per_token * (kv_tokens_read + new_tokens)
    compute_s = flops / (gpu.tflops * 1e12 * gpu.compute_efficiency)
    memory_s = memory / (gpu.tb_per_s * 1e12 * gpu.memory_efficiency)
    return max(compute_s, memory_s) * 1e3 + gpu.step_overhead_ms


def prefill_ms(m: ModelShape, gpu: Gpu, new: float, cached: float) -> float:
    return roofline_ms(m, gpu, new, 1, new * cached + new * (new + 1) / 2, cached)


def decode_ms(m: ModelShape, gpu: Gpu, batch: float, context: float) -> float:
    return roofline_ms(m, gpu, batch, batch, batch * (context + 1), batch * context)


def _grid(top: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, ... top: powers of two and the points halfway between (1.5x), so linear
    interpolation stays within ~6% of the roofline, kinks included."""
    points = {1}
    for e in range(1, top.bit_length()):
        points.update((2**e, 3 * 2 ** (e - 1)))
    return sorted(p for p in points if p <= top)


PREFILL_TOKENS = _grid(32768)
DECODE_BATCH = _grid(1024)
PREFILL_CACHED = [0] + [2**e for e in range(8, 18)]  # up to 128k, Llama-3.1's context
DECODE_CONTEXT = [0] + [2**e for e in range(7, 18)]


def first_principles(name: str, m: ModelShape, gpu: Gpu) -> Profile:
    return Profile(
        name=name,
        source=f"roofline of {m} on {gpu} (dynamo_pd.engines.mocker.profile)",
        prefill_tokens=PREFILL_TOKENS, prefill_cached=PREFILL_CACHED,
        prefill_ms=[[round(prefill_ms(m, gpu, n, c), 4) for c in PREFILL_CACHED] for n in PREFILL_TOKENS],
        decode_batch=DECODE_BATCH, decode_context=DECODE_CONTEXT,
        decode_ms=[[round(decode_ms(m, gpu, b, k), 4) for k in DECODE_CONTEXT] for b in DECODE_BATCH],
        kv_bytes_per_token=m.kv_bytes_per_token, transfer_gb_per_s=gpu.link_gb_per_s,
        host_gb_per_s=gpu.host_gb_per_s, disk_gb_per_s=gpu.disk_gb_per_s,
    )


def h100_llama8b() -> Profile:
    return first_principles("llama-3.1-8b-bf16-h100-sxm", ModelShape(), Gpu())


if __name__ == "__main__":  # print the default profile as JSON (the format --profile reads)
    print(msgspec.json.format(msgspec.json.encode(h100_llama8b()).decode()))
