"""The gateway: one frontend in front of every model its workers register.

Workers of every model and engine share one discovery and one event plane. The gateway follows
discovery once; the first worker of a model it has not seen makes it a RemoteBackend for that model
(its tokenizer loaded off the event loop from the worker's `model_path`, its own router), and each
backend sees, through a ModelView, only its model's workers minus those its health checks took out
of routing. So a backend's membership, routing, hand-offs and metrics stay exactly what they are
for one model.

    gateway = Gateway(discovery, make_backend)
    await gateway.start()
    backend = gateway.lookup("SmolLM2-135M-Instruct")   # ModelNotFoundError naming the served ones
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from dynamo_pd.frontend.config import GatewayConfig
from dynamo_pd.frontend.gateway_metrics import GatewayMetrics
from dynamo_pd.frontend.health import HealthChecker, HealthConfig
from dynamo_pd.frontend.limits import Limiter, LimitsConfig
from dynamo_pd.protocol import WorkerInfo
from dynamo_pd.runtime import Discovery, DiscoveryUnavailableError
from dynamo_pd.runtime.tasks import cancel_and_wait
from router.worker import Role

log = logging.getLogger("dynamo_pd.frontend")
APPROXIMATE_ENGINES = {"http"}  # engines whose workers publish no KV events


class ModelNotFoundError(LookupError):
    def __init__(self, model: str, served: list[str]):
        names = ", ".join(repr(m) for m in served) or "none yet"
        super().__init__(f"model {model!r} does not exist; this server serves {names}")


class ModelView:
    """The discovery one model's backend watches: its model's workers, less the excluded ones (a
    failed health check). Excluding a worker looks to the backend like the worker leaving, and
    readmitting it like the worker joining again, so the backend's own membership does the rest."""

    def __init__(self, discovery: Discovery):
        self._discovery = discovery
        self.members: dict[str, WorkerInfo] = {}
        self.excluded: set[str] = set()
        self._watchers: set[asyncio.Queue] = set()

    def __getattr__(self, name: str) -> Any:  # everything but watch() is the shared discovery's
        return getattr(self._discovery, name)

    def approximate(self, worker_id: str) -> bool:
        """The worker publishes no KV events: the router predicts its cache (router.approx)."""
        info = self.members.get(worker_id)
        return info is not None and info.engine in APPROXIMATE_ENGINES

    def visible(self) -> list[WorkerInfo]:
        return [info for wid, info in self.members.items() if wid not in self.excluded]

    def update(self, kind: str, info: WorkerInfo) -> None:
        if kind == "removed":
            if self.members.pop(info.worker_id, None) is not None and info.worker_id not in self.excluded:
                self._send("removed", info)
            self.excluded.discard(info.worker_id)
            return
        self.members[info.worker_id] = info
        if info.worker_id not in self.excluded:
            self._send("added", info)

    def exclude(self, worker_id: str) -> None:
        if worker_id in self.members and worker_id not in self.excluded:
            self.excluded.add(worker_id)
            self._send("removed", self.members[worker_id])

    def readmit(self, worker_id: str) -> None:
        if worker_id in self.excluded:
            self.excluded.discard(worker_id)
            if worker_id in self.members:
                self._send("added", self.members[worker_id])

    def _send(self, kind: str, info: WorkerInfo) -> None:
        for queue in self._watchers:
            queue.put_nowait((kind, info))

    async def watch(self, struct: type[WorkerInfo], seen: Mapping[str, WorkerInfo] | None = None
                    ) -> AsyncIterator[tuple[str, WorkerInfo]]:
        """Like Discovery.watch(struct, seen): the visible workers (WorkerInfo already, the `struct` its
        callers name), diffed against `seen` (those the caller holds), then every change."""
        queue: asyncio.Queue = asyncio.Queue()
        visible = {info.worker_id: info for info in self.visible()}
        for worker_id, info in (seen or {}).items():
            if worker_id not in visible:
                queue.put_nowait(("removed", info))
        for worker_id, info in visible.items():
            if (seen or {}).get(worker_id) != info:
                queue.put_nowait(("added", info))
        self._watchers.add(queue)
        try:
            while True:
                yield await queue.get()
        finally:
            self._watchers.discard(queue)


class ModelEntry:
    """One served model: its view of discovery and, once its tokenizer loaded, its backend."""

    def __init__(self, name: str, view: ModelView):
        self.name, self.view = name, view
        self.backend: Any = None  # a RemoteBackend once made
        self.failed = False  # the backend could not be made (logged once); retried when its workers come back

    def ready(self) -> bool:
        return self.backend is not None and self.backend.ready()

    def has_workers(self) -> bool:
        return any(info.role is not Role.PREFILL for info in self.view.visible())


# (model name, model path, its view of discovery) -> a started backend
BackendFactory = Callable[[str, str, ModelView], Awaitable[Any]]


class Gateway:
    def __init__(self, discovery: Discovery, make_backend: BackendFactory, metrics: GatewayMetrics | None = None,
                 config: GatewayConfig | None = None):
        self.discovery, self._make_backend, self.metrics = discovery, make_backend, metrics
        self.limiter = Limiter(LimitsConfig(), metrics)
        self.fallbacks: dict[str, str] = {}  # model -> the model that answers when it is unavailable
        self.health = HealthConfig(interval_s=0.0)
        if config is not None:
            self.apply(config)
        self.models: dict[str, ModelEntry] = {}
        self._tasks: set[asyncio.Task] = set()
        self._checker = HealthChecker(self)

    def apply(self, config: GatewayConfig) -> None:
        """A new configuration (a reload): requests in flight keep what they started with."""
        self.limiter.config, self.fallbacks, self.health = config.limits, dict(config.fallbacks), config.health

    async def start(self) -> None:
        self._spawn(self._watch())
        self._spawn(self._checker.run())  # idle while health.interval_s is 0

    async def close(self) -> None:
        await cancel_and_wait(list(self._tasks))
        await self._checker.close()
        for entry in self.models.values():
            if entry.backend is not None:
                await entry.backend.close()

    async def add_model(self, name: str, model_path: str = "") -> ModelEntry:
        """Serve `name` before any of its workers registers (its tokenizer loaded now; errors raised)."""
        entry = self.models.setdefault(name, ModelEntry(name, ModelView(self.discovery)))
        if entry.backend is None:
            entry.backend = await self._make_backend(name, model_path, entry.view)
        return entry

    # ---- what the HTTP app asks

    def served(self) -> list[str]:
        """The models a client may ask for now: their backend is up and a worker serves requests."""
        return sorted(name for name, entry in self.models.items() if entry.ready())

    def ready(self) -> bool:
        return bool(self.served())

    def lookup(self, name: str) -> Any:
        entry = self.models.get(name)
        if entry is None or entry.backend is None:
            raise ModelNotFoundError(name, self.served())
        return entry.backend

    def health_report(self) -> dict[str, dict]:
        """Per model: ready (a worker serves requests), its workers, those out of routing (failed health checks)."""
        return {name: {"ready": entry.ready(), "workers": sorted(entry.view.members),
                       "unhealthy": sorted(entry.view.excluded)} for name, entry in sorted(self.models.items())}

    def chain(self, name: str) -> list[str]:
        """`name`, then its fallback, the fallback's fallback, ... (each once); ModelNotFoundError when
        `name` is neither served nor given a fallback."""
        if name not in self.fallbacks and (name not in self.models or self.models[name].backend is None):
            raise ModelNotFoundError(name, self.served())
        chain = [name]
        while self.fallbacks.get(chain[-1]) not in (None, *chain):
            chain.append(self.fallbacks[chain[-1]])
        return chain

    def fell_back(self, model: str, answered_by: str) -> None:
        if self.metrics is not None:
            self.metrics.model_fallbacks.labels(model, answered_by).inc()

    def refresh_metrics(self) -> None:
        for entry in self.models.values():
            if entry.backend is None:
                continue
            entry.backend.refresh_metrics()
            approx = getattr(entry.backend.router, "approx", None)
            for worker_id in entry.backend.workers:
                if approx is not None and self.metrics is not None and entry.view.approximate(worker_id):
                    self.metrics.approx_blocks.labels(entry.name, worker_id).set(approx.blocks_of(worker_id))

    # ---- membership

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch(self) -> None:
        while True:  # an outage long enough to end a watch starts a new one
            try:
                async for kind, info in self.discovery.watch(WorkerInfo):
                    self._route_event(kind, info)
            except DiscoveryUnavailableError as exc:
                log.error("discovery unavailable (%s); retrying", exc)
                await asyncio.sleep(1.0)

    def _route_event(self, kind: str, info: WorkerInfo) -> None:
        entry = self.models.get(info.model)
        if entry is None:
            if kind == "removed":
                return
            entry = self.models[info.model] = ModelEntry(info.model, ModelView(self.discovery))
            log.info("model %r: first worker %s (%s); loading its tokenizer", info.model, info.worker_id, info.engine)
            self._spawn(self._build(entry, info.model_path))
        entry.view.update(kind, info)
        if kind == "removed" and entry.failed and not entry.view.members:
            entry.failed = False  # its next worker tries again
        elif kind == "added" and entry.failed and len(entry.view.members) == 1:
            entry.failed = False
            self._spawn(self._build(entry, info.model_path))

    async def _build(self, entry: ModelEntry, model_path: str) -> None:
        try:
            entry.backend = await self._make_backend(entry.name, model_path, entry.view)
        except Exception as exc:  # noqa: BLE001 - one model's bad path must not stop the others
            entry.failed = True
            log.error("cannot serve model %r (model path %r): %s", entry.name, model_path or entry.name, exc)
            return
        log.info("serving model %r", entry.name)
