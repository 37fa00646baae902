"""The frontend's router follows each worker's KV events: a runtime transport in, router.ingest in order.

A worker advertises its events in its WorkerInfo: a subject on the event plane (NATS: they ride this
process's one event-plane connection) or a ZMQ publisher in vLLM's wire format with its replay socket
(ours, or a vLLM engine's own). One task per worker feeds that stream to `EventIngestor.follow`;
a stream that fails (the event plane lost) is opened again every `retry_s` until the worker is
forgotten, and the ingestor's gap handling (replay, or a reset) repairs what was missed.
"""

from __future__ import annotations

import asyncio
import logging

import zmq

from dynamo_pd.protocol import WorkerInfo
from dynamo_pd.runtime import EventPlane
from dynamo_pd.runtime.errors import DiscoveryUnavailableError, EventPlaneError
from dynamo_pd.runtime.kv_events import PlaneBatchSource, ZmqBatchSource
from dynamo_pd.runtime.tasks import cancel_and_wait
from router.ingest import EventIngestor

log = logging.getLogger(__name__)

Source = PlaneBatchSource | ZmqBatchSource


class KvEventFollower:
    def __init__(self, ingestor: EventIngestor, events: EventPlane, replay_timeout_s: float = 2.0,
                 retry_s: float = 1.0) -> None:
        self._ingestor, self._events, self._replay_timeout_s = ingestor, events, replay_timeout_s
        self._retry_s = retry_s
        self._tasks: dict[str, asyncio.Task] = {}
        self._stopping: set[asyncio.Task] = set()  # forgotten, still closing their subscription: referenced

    async def follow(self, info: WorkerInfo) -> None:
        """Follow `info`'s KV events from now on (an event-plane subscription is live when this returns)."""
        if not (info.kv_events_subject or info.kv_events_endpoint):
            return
        source = await self._open(info)
        self.forget(info.worker_id)
        self._ingestor.trust(info.worker_id, info.kv_project_hashes)
        self._tasks[info.worker_id] = asyncio.create_task(self._run(info, source), name=f"kv-events-{info.worker_id}")

    async def _open(self, info: WorkerInfo) -> Source:
        if info.kv_events_subject:
            return await PlaneBatchSource.subscribe(self._events, info.kv_events_subject)
        return ZmqBatchSource(info.kv_events_endpoint, info.kv_events_replay_endpoint or None,
                              replay_timeout_s=self._replay_timeout_s)

    async def _run(self, info: WorkerInfo, source: Source | None) -> None:
        lost = False
        while True:
            try:
                source = source or await self._open(info)
                if lost:
                    log.info("worker %s: KV event stream is back", info.worker_id)
                    lost = False
                await self._ingestor.follow(info.worker_id, source)
            except (EventPlaneError, DiscoveryUnavailableError, zmq.ZMQError) as exc:
                if not lost:  # its cache view lags until the stream is back
                    log.warning("worker %s: KV event stream lost (%s); opening it again every %.1fs",
                                info.worker_id, exc, self._retry_s)
                lost = True
            except Exception:
                log.exception("worker %s: KV event subscriber stopped", info.worker_id)
                return
            finally:
                if source is not None:
                    await source.close()
                source = None
            await asyncio.sleep(self._retry_s)

    def forget(self, worker_id: str) -> None:
        """Stop following `worker_id` (it left); its task closes its subscription as it ends."""
        if (task := self._tasks.pop(worker_id, None)) is not None:
            task.cancel()
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)

    async def close(self) -> None:
        await cancel_and_wait([*self._tasks.values(), *self._stopping])
        self._tasks.clear()
