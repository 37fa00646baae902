"""NativeEngine: EngineCore behind the async Engine contract.

The core runs in one step thread; nothing else touches it. Callers hand it work as closures
on a queue, and it hands each request's outputs back to that request's event loop with
`call_soon_threadsafe`, so the asyncio loop never waits on a forward pass.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import torch

from dynamo_pd.engines.base import Engine, EngineConfig, EngineRole, KVLoader
from dynamo_pd.engines.native.core import EngineCore, EngineStats
from dynamo_pd.protocol import EngineOutput, EngineRequest
from dynamo_pd.runtime import RequestContext
from router.events import KVEvent

log = logging.getLogger(__name__)

_IDLE_POLL_S = 0.5  # how often an idle step thread wakes (lease expiry, shutdown)
_REPLY_TIMEOUT_S = 30.0  # the step thread answers a command or confirms an abort within this


@dataclass
class _LoadOrder:
    """DECODE role: blocks are reserved; the caller's loop must fill them."""

    block_ids: list[int]
    cached_blocks: int


class NativeEngine(Engine):
    kv_handoffs = ("pull", "push")

    def __init__(self, config: EngineConfig, kv_loader: KVLoader | None = None):
        if config.role is EngineRole.DECODE and kv_loader is None:
            raise ValueError("a DECODE NativeEngine needs a kv_loader to import prompt KV")
        self.config = config
        self.role = config.role
        self.kv_loader = kv_loader
        self._core: EngineCore | None = None
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._sinks: dict[str, Callable[[Any], None]] = {}  # request id -> delivery to its loop
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.stats = EngineStats()

    # ---- lifecycle

    async def start(self) -> None:
        if self._core is not None:
            return
        self._core = await asyncio.to_thread(EngineCore, self.config)
        self.stats = self._core.stats()
        self._thread = threading.Thread(target=self._run, name="native-engine-step", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        if self._thread is None:
            return
        self._commands.put(self._shutdown)
        await asyncio.to_thread(self._thread.join, _REPLY_TIMEOUT_S)
        self._thread = None

    def _core_or_raise(self) -> EngineCore:
        if self._core is None or self._thread is None:
            raise RuntimeError("NativeEngine is not started: await engine.start() first")
        return self._core

    # ---- what workers and kv_transfer read

    @property
    def tokenizer(self):
        return self._core_or_raise().tokenizer

    @property
    def max_model_len(self) -> int:
        return self._core_or_raise().max_model_len

    @property
    def kv_cache(self) -> torch.Tensor:
        """[layers, 2 (K, V), blocks, block_size, kv_heads, head_dim], one contiguous tensor."""
        return self._core_or_raise().kv_cache

    def drain_kv_events(self) -> list[KVEvent]:
        """KV events since the last call, in order (safe from any thread)."""
        return self._core_or_raise().block_manager.drain_events()

    async def release_handoff(self, request_id: str) -> None:
        core = self._core_or_raise()
        await self._call(core.release_handoff, request_id)

    async def reset_prefix_cache(self) -> None:
        core = self._core_or_raise()
        await self._call(core.reset_prefix_cache)

    # ---- requests

    async def generate(self, request: EngineRequest, context: RequestContext) -> AsyncIterator[EngineOutput]:
        core = self._core_or_raise()
        core.check_request(request)
        rid = request.request_id
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()

        def deliver(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(inbox.put_nowait, item)
            except RuntimeError:  # the caller's loop is closed: nobody is listening
                self._commands.put(lambda: self._end_request(rid, "abort"))

        self._commands.put(lambda: self._add(request, deliver))
        done = aborted = False
        try:
            while True:
                if context.cancelled and not aborted:
                    aborted = True
                    self._commands.put(lambda: self._end_request(rid, "abort"))
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
                if item.finish_reason is not None:
                    done = True
                yield item
                if done:
                    return
        finally:
            if not done and not aborted:  # consumer closed the stream or was cancelled
                self._commands.put(lambda: self._end_request(rid, "abort"))

    async def _receive(self, inbox: asyncio.Queue, context: RequestContext, aborted: bool) -> Any:
        """Next item for this request; None when the context was cancelled first."""
        if not inbox.empty():
            return inbox.get_nowait()
        if aborted:
            try:
                return await asyncio.wait_for(inbox.get(), _REPLY_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise RuntimeError("native engine did not confirm an abort in time") from None
        get = asyncio.ensure_future(inbox.get())
        cancelled = asyncio.ensure_future(context.wait_cancelled())
        try:
            while not get.done() and not cancelled.done():
                await asyncio.wait({get, cancelled}, timeout=_IDLE_POLL_S * 4,
                                   return_when=asyncio.FIRST_COMPLETED)
                if self._thread is None or not self._thread.is_alive():
                    raise RuntimeError("native engine step thread is not running")
        finally:
            cancelled.cancel()
            if not get.done():
                get.cancel()
        return get.result() if get.done() and not get.cancelled() else None

    async def _load(self, request: EngineRequest, order: _LoadOrder) -> None:
        rid = request.request_id
        try:
            first_token_id = await asyncio.wait_for(
                self.kv_loader(request.handoff, order.block_ids, order.cached_blocks),
                timeout=self.config.handoff_lease_s + request.handoff.wait_s)
        except Exception as exc:  # noqa: BLE001 - any loader failure ends this request, not the engine
            message = f"KV load for {rid!r} failed: {exc!r}"
            self._commands.put(lambda: self._end_request(rid, "error", message))
            return
        self._commands.put(lambda: self._emit(self._core.finish_load(rid, first_token_id)))

    async def _call(self, fn: Callable, *args: Any) -> Any:
        """Run `fn(*args)` on the step thread and return its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def command() -> None:
            try:
                future.set_result(fn(*args))
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)

        self._commands.put(command)
        return await asyncio.wait_for(asyncio.wrap_future(future), _REPLY_TIMEOUT_S)

    # ---- the step thread

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

    def _shutdown(self) -> None:
        for rid in list(self._core.seqs):
            self._end_request(rid, "abort")
        for rid in list(self._core.held):
            self._core.release_handoff(rid)
        self._stopping = True

    def _run(self) -> None:
        core = self._core
        while not self._stopping:
            self._run_commands(block=not core.has_work or core.stalled)
            core.expire_handoffs()
            outputs = []
            if core.has_work:
                try:
                    outputs = core.step()
                except Exception as exc:  # fail the batch, keep serving
                    log.exception("native engine step failed")
                    outputs = core.fail_all(f"engine step failed: {exc!r}")
            self.stats = core.stats()  # before delivery: a caller seeing an output sees stats after it
            for out in outputs:
                self._emit(out)
            for seq in core.take_new_loads():
                order = _LoadOrder(list(seq.block_table), (seq.num_cached_tokens or 0) // core.block_manager.block_size)
                self._sinks[seq.request_id](order)

    def _run_commands(self, block: bool) -> None:
        timeout = _IDLE_POLL_S
        if self._core.held:
            next_expiry = min(deadline for _, deadline in self._core.held.values())
            timeout = min(timeout, max(0.0, next_expiry - time.monotonic()))
        try:
            command = self._commands.get(block=block, timeout=timeout if block else None)
        except queue.Empty:
            return
        while True:
            try:
                command()
            except Exception:  # a bad command must not kill the step thread
                log.exception("native engine command failed")
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
