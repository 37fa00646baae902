"""Active load per worker: predicted by the router, corrected by what workers report.

Prediction follows each request the router (or a replica, through router.replica_sync) placed:
  route          -> the worker gains the request's uncached prompt tokens (to prefill) and its blocks
  prefill done   -> (first token) the prefill tokens leave
  finished       -> the blocks leave
Blocks are KV the worker holds, as its reports count them: a prefix block that requests in flight on one worker
share (its engine's prefix cache) counts once, until the last of them finishes, whichever router placed them.
Counted whole, a burst of prompts over 4 shared prefixes read as more than 16 workers' pools, and the busy check
refused some.
Correction: a worker's LoadMetrics report what it really holds (requests from elsewhere, blocks
freed early, output growth). At each report the difference report - prediction becomes the worker's
offset, added to the prediction until the next report, so load placed after the report still counts.
The prediction it is taken against leaves out the placements the report cannot hold yet: those made
after the worker's counts were fixed (LoadMetrics.counted_s_ago, its last step's start), less
ARRIVAL_S for the request's way to the engine. Without that, a report taken while a burst's requests
were on their way cancelled them until the next report, and the burst piled onto the workers whose
reports came in between (Mooncake's first rows: three of six prompts of 7,000 tokens on one of four).
A worker whose reports stop (it hangs, or the event plane is down) keeps its offset for
`HOLD_INTERVALS` report intervals (the gap between its last two reports), then the offset fades
linearly to 0 over `FADE_INTERVALS` more: a near-full worker gone quiet does not look busy forever.
A report also carries the worker's measured step costs (StepCosts) and KV fetch costs (FetchCosts), which the
`time` policy predicts with.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from router.indexer import WorkerId
from router.worker import LoadMetrics, Role

HOLD_INTERVALS = 2.0
FADE_INTERVALS = 3.0
# The most a placement takes to reach the worker's engine (the frontend's send, the RPC, the engine's command
# queue): younger than that at the counts' time, it is taken as not in them. Too long only counts a request
# twice until the next report; too short loses it until then.
ARRIVAL_S = 0.05
RECENT_S = 60.0  # a placement this old is in any report (counts older than that: a stalled worker's)


class LoadKey(NamedTuple):
    """One placement: a request on one pool, placed by this router ("") or by the replica `router_id`."""

    request_id: str
    role: Role
    router_id: str = ""


class StepCosts(NamedTuple):
    """What a worker's steps cost: seconds = decode_s + decode_s_per_block * (KV blocks of its decode
    rows) + prefill_s_per_token * (tokens it prefills); output_tokens per request. None: unknown."""

    prefill_s_per_token: float | None = None
    decode_s: float | None = None
    decode_s_per_block: float | None = None
    output_tokens: float | None = None


class FetchCosts(NamedTuple):
    """What a worker's KV fetches cost, as it measured them: copying blocks back up from its host or disk
    tier, and pulling them from a peer; each takes fixed_s + bytes / bytes_per_s. block_bytes: one block's
    KV. None: not measured yet (or not an engine that fetches)."""

    block_bytes: int | None = None
    host_bytes_per_s: float | None = None
    host_fixed_s: float | None = None
    disk_bytes_per_s: float | None = None
    disk_fixed_s: float | None = None
    pull_bytes_per_s: float | None = None
    pull_fixed_s: float | None = None


class WorkerLoad(NamedTuple):  # a NamedTuple: routing builds one per worker per request
    """The router's view of one worker at the moment of a decision."""

    worker_id: WorkerId
    prefill_tokens: int
    blocks: int
    requests: int
    capacity_blocks: int


@dataclass
class _Placement:
    worker_id: WorkerId
    prefill_tokens: int
    blocks: int  # the blocks it added to the worker's: its own, and the shared ones no other placement held
    unhashed: int  # its blocks past `hashes` (a partial last block), which no other placement shares
    hashes: Sequence[int]
    placed_at: float
    prefill_done: bool = False
    finished: bool = False


@dataclass
class _Worker:
    capacity_blocks: int
    prefill_tokens: int = 0
    blocks: int = 0
    requests: int = 0
    prefill_offset: int = 0
    blocks_offset: int = 0
    requests_offset: int = 0
    held: dict[int, int] = field(default_factory=dict)  # block hash -> the placements holding it
    costs: StepCosts = StepCosts()
    fetch: FetchCosts = FetchCosts()
    reported_at: float | None = None  # clock time of the last report
    report_interval_s: float = 0.0  # gap between the last two reports (0: one report or none yet)
    recent: deque[_Placement] = field(default_factory=deque)  # placements a report may not hold yet, oldest first


class LoadTracker:
    def __init__(self, *, default_report_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`default_report_interval_s`: assumed until a worker has reported twice."""
        self._default_interval_s = default_report_interval_s
        self._clock = clock
        self._workers: dict[WorkerId, _Worker] = {}
        self._placements: dict[LoadKey, _Placement] = {}

    def add_worker(self, worker_id: WorkerId, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"worker {worker_id!r}: capacity_blocks must be positive, got {capacity_blocks}")
        self._workers.setdefault(worker_id, _Worker(capacity_blocks)).capacity_blocks = capacity_blocks

    def remove_worker(self, worker_id: WorkerId) -> None:
        """Forget the worker and the placements on it."""
        self._workers.pop(worker_id, None)
        for key in [key for key, p in self._placements.items() if p.worker_id == worker_id]:
            del self._placements[key]

    def place(self, key: LoadKey, worker_id: WorkerId, prefill_tokens: int, blocks: int,
              hashes: Sequence[int] = ()) -> None:
        """`hashes`: the block hashes of the request's first blocks where the worker's prefix cache shares them
        (none: it holds all `blocks` alone)."""
        if key in self._placements:
            raise ValueError(
                f"request {key!r} is already placed on worker {self._placements[key].worker_id!r}"
            )
        worker = self._worker(worker_id)
        held, shared = worker.held, 0
        for h in hashes:
            n = held.get(h, 0)
            shared += n > 0
            held[h] = n + 1
        added = blocks - shared
        self._placements[key] = placement = _Placement(
            worker_id, prefill_tokens, added, blocks - len(hashes), hashes, self._clock(),
            prefill_done=prefill_tokens == 0,
        )
        recent = worker.recent
        recent.append(placement)
        while recent[0].finished or recent[0].placed_at <= placement.placed_at - RECENT_S:  # bounded without reports
            recent.popleft()
        worker.prefill_tokens += prefill_tokens
        worker.blocks += added
        worker.requests += 1

    def prefill_done(self, key: LoadKey) -> bool:
        placement = self._placements.get(key)
        if placement is None or placement.prefill_done:
            return False
        placement.prefill_done = True
        worker = self._workers.get(placement.worker_id)
        if worker is not None:
            worker.prefill_tokens -= placement.prefill_tokens
        return True

    def finish(self, key: LoadKey) -> bool:
        self.prefill_done(key)
        placement = self._placements.pop(key, None)
        if placement is None:
            return False
        placement.finished = True
        worker = self._workers.get(placement.worker_id)
        if worker is not None:
            freed, held = placement.unhashed, worker.held
            for h in placement.hashes:
                n = held[h] - 1
                if n:
                    held[h] = n
                else:
                    del held[h]
                    freed += 1
            worker.blocks -= freed
            worker.requests -= 1
        return True

    def report(self, metrics: LoadMetrics) -> None:
        worker = self._worker(metrics.worker_id)
        now = self._clock()
        if worker.reported_at is not None:
            worker.report_interval_s = now - worker.reported_at
        worker.reported_at = now
        worker.capacity_blocks = metrics.num_total_blocks or worker.capacity_blocks
        counted = now - metrics.counted_s_ago - ARRIVAL_S
        while worker.recent and worker.recent[0].placed_at <= counted:
            worker.recent.popleft()  # in this report's counts, and in every later one's
        unseen = [p for p in worker.recent if not p.finished]
        worker.prefill_offset = (metrics.active_prefill_tokens - worker.prefill_tokens
                                 + sum(p.prefill_tokens for p in unseen if not p.prefill_done))
        worker.blocks_offset = (metrics.num_total_blocks - metrics.num_free_blocks - worker.blocks
                                + sum(p.blocks for p in unseen))
        worker.requests_offset = metrics.num_running + metrics.num_waiting - worker.requests + len(unseen)
        worker.costs = StepCosts(metrics.prefill_s_per_token, metrics.decode_s, metrics.decode_s_per_block,
                                 metrics.output_tokens)
        worker.fetch = FetchCosts(*(getattr(metrics, name) for name in FetchCosts._fields))

    def load(self, worker_id: WorkerId) -> WorkerLoad:
        w = self._worker(worker_id)
        weight = self._offset_weight(w)
        prefill, blocks, requests = (
            w.prefill_tokens + round(w.prefill_offset * weight),
            w.blocks + round(w.blocks_offset * weight),
            w.requests + round(w.requests_offset * weight),
        )
        return WorkerLoad(
            worker_id,
            prefill if prefill > 0 else 0,
            blocks if blocks > 0 else 0,
            requests if requests > 0 else 0,
            w.capacity_blocks,
        )

    def _offset_weight(self, w: _Worker) -> float:
        """1 while the worker reports; fading to 0 once its reports are overdue."""
        if w.reported_at is None:
            return 1.0
        interval = w.report_interval_s or self._default_interval_s
        overdue = (self._clock() - w.reported_at) / interval - HOLD_INTERVALS
        return 1.0 if overdue <= 0 else max(0.0, 1.0 - overdue / FADE_INTERVALS)

    def costs(self, worker_id: WorkerId) -> StepCosts:
        return self._worker(worker_id).costs

    def fetch_costs(self, worker_id: WorkerId) -> FetchCosts:
        return self._worker(worker_id).fetch

    def _worker(self, worker_id: WorkerId) -> _Worker:
        worker = self._workers.get(worker_id)
        if worker is None:
            raise KeyError(f"unknown worker {worker_id!r}; add it first")
        return worker
