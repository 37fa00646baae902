"""What the router knows a worker by: its role (the pool it serves in) and the load it reports.

Defined here, in the pure library, and used by dynamo_pd (engines, discovery, the load publisher).
"""

from __future__ import annotations

import enum

import msgspec


class Role(str, enum.Enum):
    """A worker's role, and the router pool it joins."""

    AGGREGATED = "aggregated"  # prompt and decode
    PREFILL = "prefill"  # the prompt, then hands its KV to a decode worker
    DECODE = "decode"  # continues from KV computed elsewhere (or prefills itself)


class LoadMetrics(msgspec.Struct, kw_only=True):
    """What a worker publishes periodically so routers can correct their predicted load."""

    worker_id: str
    num_running: int
    num_waiting: int
    num_free_blocks: int  # blocks no running request holds (evictable cached blocks count as free)
    num_total_blocks: int
    active_prefill_tokens: int = 0  # prompt tokens admitted but not yet prefilled
    # how long before it sent this report the worker's counts were fixed: a request that reached its engine
    # since is not in them (0: as of the report)
    counted_s_ago: float = 0.0
    # the worker's measured step costs (router.load.StepCosts); None: not measured yet, or not an engine that does
    prefill_s_per_token: float | None = None
    decode_s: float | None = None
    decode_s_per_block: float | None = None
    output_tokens: float | None = None
    # its measured KV fetch costs (router.load.FetchCosts): copying back from its tiers, pulling from a peer
    block_bytes: int | None = None
    host_bytes_per_s: float | None = None
    host_fixed_s: float | None = None
    disk_bytes_per_s: float | None = None
    disk_fixed_s: float | None = None
    pull_bytes_per_s: float | None = None
    pull_fixed_s: float | None = None
