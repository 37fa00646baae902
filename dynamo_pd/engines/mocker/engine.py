"""MockerEngine: MockerCore behind the async Engine contract, on the caller's event loop.

    python -m dynamo_pd.serve --engine mocker --speedup 10          # a whole deployment of mockers
    python -m dynamo_pd.mocker --workers 16 --role aggregated       # 16 mocker workers in one process

No model runs, so no thread is needed: one asyncio task per engine schedules a batch, waits out the
time the profile gives it on a clock (real, or a fake one in tests), then delivers its outputs.
Commands (new requests, aborts, finished KV loads) that arrive meanwhile run before the next step,
as the native engine's step thread runs them. Many engines share one loop, so many workers share
one process. Engine flags: `--profile PATH` (a JSON Profile; default: Llama-3.1-8B on one H100,
see profile.py), `--speedup X` (simulated time runs X times faster). `--kv-cache-memory-gb` is the
simulated GPU's KV memory (an 8B model on one 80 GB H100 leaves about 54 GB for KV).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import torch

from dynamo_pd.engines.base import Engine, EngineConfig, EngineRole, KVLoader
from dynamo_pd.engines.mocker.core import MockerCore, TextTable
from dynamo_pd.engines.mocker.profile import Profile, h100_llama8b
from dynamo_pd.engines.native.core import EngineStats
from dynamo_pd.protocol import EngineOutput, EngineRequest
from dynamo_pd.runtime import RequestContext
from dynamo_pd.runtime.tasks import cancel_and_wait
from router.events import KVEvent

log = logging.getLogger(__name__)

_IDLE_POLL_S = 0.5  # how often an idle engine wakes (lease expiry)
_OPTIONS = {"profile", "speedup"}


class Clock:
    """Real time."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class FakeClock(Clock):
    """Simulated time for tests: a sleep returns at once and moves the clock to its wake-up time if
    that is later, so sleeps that start together overlap and consecutive ones add up."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        wake = self.t + seconds
        await asyncio.sleep(0)
        self.t = max(self.t, wake)


@dataclass
class _LoadOrder:
    """DECODE role: blocks are reserved; the request's consumer must fill them."""

    block_ids: list[int]
    cached_blocks: int


class MockerEngine(Engine):
    kv_handoffs = ("pull", "push")

    def __init__(self, config: EngineConfig, kv_loader: KVLoader | None = None, clock: Clock | None = None):
        if config.role is EngineRole.DECODE and kv_loader is None:
            raise ValueError("a DECODE MockerEngine needs a kv_loader to import prompt KV")
        unknown = sorted(set(config.extra) - _OPTIONS)
        if unknown:
            raise ValueError(f"unknown mocker option(s) {', '.join(unknown)}: "
                             f"it takes --profile PATH and --speedup X")
        self.speedup = float(config.extra.get("speedup", 1.0))
        if not self.speedup > 0:
            raise ValueError(f"--speedup must be positive, got {config.extra['speedup']!r}")
        self.profile = Profile.load(config.extra["profile"]) if "profile" in config.extra else h100_llama8b()
        self.config = config
        self.role = config.role
        self.kv_loader = kv_loader
        self.clock = clock or Clock()
        self.stats = EngineStats()
        self._core: MockerCore | None = None
        self._task: asyncio.Task | None = None
        self._commands: list[Callable[[], None]] = []
        self._wake: asyncio.Event | None = None
        self._sinks: dict[str, Callable[[Any], None]] = {}  # request id -> its generator's inbox

    # ---- lifecycle

    async def start(self) -> None:
        if self._task is not None:
            return
        self._core = await asyncio.to_thread(MockerCore, self.config, self.profile, self.speedup)
        self.stats = self._core.stats()
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is None:
            return
        core = self._core  # the loop waits (a step, or for work) and is cancelled before it runs again
        for rid in list(core.seqs):
            self._end_request(rid, "abort")
        for rid in list(core.held):
            core.release_handoff(rid)
        self.stats = core.stats()
        await cancel_and_wait([self._task])
        self._task = None

    def _core_or_raise(self) -> MockerCore:
        if self._task is None:
            raise RuntimeError("MockerEngine is not started: await engine.start() first")
        return self._core

    # ---- what workers and kv_transfer read

    @property
    def tokenizer(self) -> TextTable:
        return self._core_or_raise().tokenizer

    @property
    def max_model_len(self) -> int:
        return self._core_or_raise().max_model_len

    @property
    def kv_cache(self) -> torch.Tensor:
        """The stand-in KV cache, [1, 2, blocks, block_size, 1, 4] (native layout)."""
        return self._core_or_raise().kv_cache

    def drain_kv_events(self) -> list[KVEvent]:
        return self._core_or_raise().block_manager.drain_events()

    async def release_handoff(self, request_id: str) -> None:
        self._core_or_raise().release_handoff(request_id)  # held blocks are in no batch: safe mid-step
        self._wake.set()

    # ---- requests

    async def generate(self, request: EngineRequest, context: RequestContext) -> AsyncIterator[EngineOutput]:
        core = self._core_or_raise()
        core.check_request(request)
        rid = request.request_id
        inbox: asyncio.Queue = asyncio.Queue()
        self._do(lambda: self._add(request, inbox.put_nowait))
        done = aborted = False
        try:
            while True:
                if context.cancelled and not aborted:
                    aborted = True
                    self._do(lambda: self._end_request(rid, "abort"))
                item = await self._receive(inbox, context, aborted)
                if item is None:
                    continue  # cancelled while waiting: abort at the top of the loop
                if isinstance(item, BaseException):
                    done = True  # rejected before it started (e.g. a duplicate id): nothing to abort
                    raise item
                if isinstance(item, _LoadOrder):
                    if not aborted:
                        await self._load(request, item)
                    continue
                done = item.finish_reason is not None
                yield item
                if done:
                    return
        finally:
            if not done and not aborted:  # the consumer closed the stream or was cancelled
                self._do(lambda: self._end_request(rid, "abort"))

    async def _receive(self, inbox: asyncio.Queue, context: RequestContext, aborted: bool) -> Any:
        """The request's next item; None when the context was cancelled first."""
        if not inbox.empty():
            return inbox.get_nowait()
        loop_task = self._task
        if loop_task is None:
            raise RuntimeError("mocker engine is stopped")
        get = asyncio.ensure_future(inbox.get())
        cancelled = None if aborted else asyncio.ensure_future(context.wait_cancelled())
        try:
            await asyncio.wait([f for f in (get, cancelled, loop_task) if f is not None],
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            for future in (get, cancelled):
                if future is not None and not future.done():
                    future.cancel()
        if get.done() and not get.cancelled():
            return get.result()
        if not inbox.empty():  # delivered (by stop(), say) while `get` had not run yet
            return inbox.get_nowait()
        if loop_task.done():
            raise RuntimeError("mocker engine loop is not running")
        return None

    async def _load(self, request: EngineRequest, order: _LoadOrder) -> None:
        rid, handoff = request.request_id, request.handoff
        try:
            first_token_id = await asyncio.wait_for(
                self.kv_loader(handoff, order.block_ids, order.cached_blocks),
                timeout=self.config.handoff_lease_s + handoff.wait_s)
            # The stand-in KV has moved; the profiled model's KV takes this long on the profiled link.
            moved = max(0, handoff.num_tokens - order.cached_blocks * self.config.block_size)
            await self.clock.sleep(self.profile.transfer_s(moved) / self.speedup)
        except Exception as exc:  # noqa: BLE001 - any loader failure ends this request, not the engine
            message = f"KV load for {rid!r} failed: {exc!r}"
            self._do(lambda: self._end_request(rid, "error", message))
            return
        self._do(lambda: self._emit(self._core.finish_load(rid, first_token_id)))

    # ---- the engine loop (commands and steps)

    def _do(self, command: Callable[[], None]) -> None:
        self._commands.append(command)
        self._wake.set()

    def _add(self, request: EngineRequest, deliver: Callable[[Any], None]) -> None:
        try:
            self._core.add_request(request)
        except Exception as exc:  # noqa: BLE001 - the caller raises it
            deliver(exc)
            return
        self._sinks[request.request_id] = deliver

    def _emit(self, out: EngineOutput | None) -> None:
        if out is None:
            return
        deliver = self._sinks.pop(out.request_id) if out.finish_reason else self._sinks.get(out.request_id)
        if deliver is not None:
            deliver(out)

    def _end_request(self, rid: str, reason: str, error: str | None = None) -> None:
        self._emit(self._core.end_request(rid, reason, error))

    async def _run(self) -> None:
        core = self._core
        while True:
            await self._wait_for_work()
            commands, self._commands = self._commands, []
            for command in commands:
                try:
                    command()
                except Exception:  # a bad command must not stop the engine
                    log.exception("mocker engine command failed")
            core.expire_handoffs()
            outputs = []
            if core.has_work:
                try:
                    outputs = core.step()
                except Exception as exc:  # fail the batch, keep serving
                    log.exception("mocker engine step failed")
                    outputs = core.fail_all(f"engine step failed: {exc!r}")
                if core.step_s:
                    await self.clock.sleep(core.step_s)  # the forward pass the profile gives this batch
            self.stats = core.stats()  # before delivery: a caller seeing an output sees stats after it
            for out in outputs:
                self._emit(out)
            for seq in core.take_new_loads():
                cached_blocks = (seq.num_cached_tokens or 0) // core.block_manager.block_size
                self._sinks[seq.request_id](_LoadOrder(list(seq.block_table), cached_blocks))

    async def _wait_for_work(self) -> None:
        core = self._core
        if self._commands or (core.has_work and not core.stalled):
            return
        timeout = _IDLE_POLL_S
        if core.held:
            next_expiry = min(deadline for _, deadline in core.held.values())
            timeout = min(timeout, max(0.0, next_expiry - time.monotonic()))
        self._wake.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)
