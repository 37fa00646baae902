"""What the planner reads each interval, all of it from the deployment's own planes (no scraping):

  discovery                    the registered workers (WorkerInfo): a pool's serving workers, and what
                               one holds (max_num_seqs, KV blocks, block size)
  <namespace>.router.load      every placement a frontend's router makes (router.replica_sync.LoadUpdate,
                               which frontends already publish for each other): the arrivals on each pool,
                               with the uncached prompt tokens the chosen worker computes, the prompt's
                               blocks; and each request's end, with the TTFT and ITL its client saw
                               (TTFT: its prefill or aggregated pool's; ITL: its decode or aggregated one's)
  <namespace>.load             each worker's LoadMetrics every report interval: prefill tokens queued,
                               requests running, and the step costs it measured (router.load.StepCosts)
Subscribing is what the frontend does, so the planner sees exactly the load its routers act on, from
every frontend at once, with no endpoint to configure; it says hello there as a frontend does, since a
frontend publishes only while a reader is there. Costs are each pool's median over the workers
that measured them, kept when those workers leave.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from dynamo_pd.frontend.membership import Membership
from dynamo_pd.frontend.replicas import hello_subject, say_hello
from dynamo_pd.frontend.resubscribe import follow_subject
from dynamo_pd.planner.predict import Arrival
from dynamo_pd.protocol import LoadMetrics, WorkerInfo
from dynamo_pd.runtime import Discovery, EventPlane
from dynamo_pd.runtime.tasks import cancel_and_wait
from router import replica_sync

log = logging.getLogger("dynamo_pd.planner")

_load_decoder = msgspec.msgpack.Decoder(LoadMetrics)


@dataclass(frozen=True)
class PoolCosts:
    """A pool's step costs (None: no worker of it measured that yet)."""

    prefill_s_per_token: float | None = None
    decode_s: float | None = None  # None also while it is 0: no decode-only step ran
    decode_s_per_block: float | None = None
    output_tokens: float | None = None


@dataclass(frozen=True)
class PoolObservation:
    pool: str
    interval_s: float
    workers: tuple[str, ...]  # registered, serving
    arrivals: tuple[Arrival, ...]  # placed on the pool during the interval
    queued_prefill_tokens: int  # now, over the pool's workers
    running: int  # requests running or waiting on them, now
    costs: PoolCosts
    ttfts: tuple[float, ...] = ()  # seconds, of the requests that ended during the interval
    itls: tuple[float, ...] = ()  # their mean ITLs
    max_num_seqs: int = 0  # of one worker (the least in the pool); 0: no worker registered
    kv_blocks: int = 0
    block_size: int = 0


class Observer:
    def __init__(self, discovery: Discovery, events: EventPlane, namespace: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._events, self._clock = events, clock
        self._subjects = (f"{namespace}.load", f"{namespace}.router.load")
        # frontends publish their placements only while a reader says it is there (frontend.replicas)
        self._hello = hello_subject(namespace, f"planner-{uuid.uuid4().hex[:8]}")
        self.membership = Membership(discovery, self._joined, self._left)
        self._reports: dict[str, LoadMetrics] = {}
        self._arrivals: dict[str, list[Arrival]] = {}
        self._latencies: dict[str, tuple[list[float], list[float]]] = {}  # pool -> (TTFTs, ITLs)
        self._costs: dict[str, PoolCosts] = {}
        self._since = clock()
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self.membership.run())]
        for subject, handle in zip(self._subjects, (self._on_load, self._on_update)):
            live = await self._events.subscribe(subject)  # before start returns
            self._tasks.append(asyncio.create_task(follow_subject(self._events, subject, handle, live)))
        self._tasks.append(asyncio.create_task(say_hello(self._events, self._hello)))

    async def close(self) -> None:
        await cancel_and_wait(self._tasks)

    async def _joined(self, info: WorkerInfo) -> None:
        log.info("worker %s (%s) registered", info.worker_id, info.role.value)

    def _left(self, info: WorkerInfo) -> None:
        self._reports.pop(info.worker_id, None)
        log.info("worker %s (%s) left", info.worker_id, info.role.value)

    def _on_load(self, _subject: str, payload: bytes) -> None:
        with contextlib.suppress(msgspec.DecodeError):
            report = _load_decoder.decode(payload)
            if report.worker_id in self.membership.workers:
                self._reports[report.worker_id] = report

    def _on_update(self, _subject: str, payload: bytes) -> None:
        try:
            updates = replica_sync.decode(payload)
        except msgspec.DecodeError:
            return
        for update in updates:
            pool, _, _ = update.key.partition(":")
            if update.kind == "place":
                self._arrivals.setdefault(pool, []).append(Arrival(update.prefill_tokens, update.blocks))
            elif update.kind == "finish":
                ttfts, itls = self._latencies.setdefault(pool, ([], []))
                if update.ttft_s > 0 and pool != "decode":
                    ttfts.append(update.ttft_s)
                if update.itl_s > 0 and pool != "prefill":
                    itls.append(update.itl_s)

    def registered(self, pool: str) -> list[WorkerInfo]:
        return [w for w in self.membership.workers.values() if w.role.value == pool]

    def collect(self, pools: tuple[str, ...]) -> dict[str, PoolObservation]:
        """Each pool's interval since the last collect (its arrivals start again) and its state now."""
        now = self._clock()
        interval, self._since = now - self._since, now
        arrivals, self._arrivals = self._arrivals, {}
        latencies, self._latencies = self._latencies, {}
        return {pool: self._observe(pool, interval, arrivals.get(pool, []), latencies.get(pool, ([], [])))
                for pool in pools}

    def _observe(self, pool: str, interval_s: float, arrivals: list[Arrival],
                 latencies: tuple[list[float], list[float]]) -> PoolObservation:
        workers = self.registered(pool)
        reports = [self._reports[w.worker_id] for w in workers if w.worker_id in self._reports]
        self._costs[pool] = costs = self._pool_costs(self._costs.get(pool, PoolCosts()), reports)
        return PoolObservation(
            pool=pool, interval_s=interval_s, workers=tuple(sorted(w.worker_id for w in workers)),
            arrivals=tuple(arrivals), queued_prefill_tokens=sum(r.active_prefill_tokens for r in reports),
            running=sum(r.num_running + r.num_waiting for r in reports), costs=costs,
            ttfts=tuple(latencies[0]), itls=tuple(latencies[1]),
            max_num_seqs=min((w.max_num_seqs for w in workers if w.max_num_seqs), default=0),
            kv_blocks=min((r.num_total_blocks for r in reports if r.num_total_blocks), default=0)
            or min((w.num_kv_blocks for w in workers if w.num_kv_blocks), default=0),
            block_size=workers[0].block_size if workers else 0)

    @staticmethod
    def _pool_costs(known: PoolCosts, reports: list[LoadMetrics]) -> PoolCosts:
        def median(values: list[float | None], before: float | None) -> float | None:
            measured = [v for v in values if v is not None]
            return statistics.median(measured) if measured else before

        decoders = [r for r in reports if r.decode_s]  # 0: no decode-only step ran there yet
        return PoolCosts(
            prefill_s_per_token=median([r.prefill_s_per_token for r in reports], known.prefill_s_per_token),
            decode_s=median([r.decode_s for r in decoders], known.decode_s),
            decode_s_per_block=median([r.decode_s_per_block for r in decoders], known.decode_s_per_block),
            output_tokens=median([r.output_tokens for r in reports], known.output_tokens))
