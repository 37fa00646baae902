"""NativeEngine: EngineCore behind the async Engine contract.

The core runs in one step thread; nothing else touches it. Callers hand it work as closures
on a queue, and it hands each request's outputs back to that request's event loop with
`call_soon_threadsafe`, so the asyncio loop never waits on a forward pass. The request life
(sinks, generate, aborts, KV loads) is driver.py's, shared with the mocker.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from dynamo_pd.engines.base import EngineConfig, KVLoader
from dynamo_pd.engines.native.core import EngineCore
from dynamo_pd.engines.native.driver import CoreDriver
from dynamo_pd.runtime.inbox import Inbox

log = logging.getLogger(__name__)

_REPLY_TIMEOUT_S = 30.0  # the step thread answers a command or confirms an abort within this


class NativeEngine(CoreDriver):
    def __init__(self, config: EngineConfig, kv_loader: KVLoader | None = None):
        super().__init__(config, kv_loader)
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ---- lifecycle

    async def start(self) -> None:
        if self._core is not None:
            return
        self._core = await asyncio.to_thread(EngineCore, self.config)
        await asyncio.to_thread(self._core.grammars.compiler)  # grammar.py's Grammars: why before serving
        self.stats = self._core.stats()
        self._thread = threading.Thread(target=self._run, name="native-engine-step", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        if self._thread is None:
            return
        self._commands.put(self._shutdown)
        await asyncio.to_thread(self._thread.join, _REPLY_TIMEOUT_S)
        self._thread = None
        await asyncio.to_thread(self._core.close)

    def _core_or_raise(self) -> EngineCore:
        if self._core is None or self._thread is None:
            raise RuntimeError("NativeEngine is not started: await engine.start() first")
        return self._core

    # ---- what workers and kv_transfer read (and CoreDriver's tokenizer, kv_cache, ...)

    async def release_handoff(self, request_id: str) -> None:
        core = self._core_or_raise()
        await self._call(core.release_handoff, request_id)

    async def pin_prefix(self, pin_id: str, hashes: list[int]) -> list[int] | None:
        """A peer reads the cached blocks of this prefix (EngineCore.pin_prefix)."""
        core = self._core_or_raise()
        return await self._call(core.pin_prefix, pin_id, hashes)

    async def reset_prefix_cache(self) -> None:
        core = self._core_or_raise()
        await self._call(core.reset_prefix_cache)

    # ---- requests: CoreDriver.generate, across threads

    def _do(self, command: Callable[[], None]) -> None:
        self._commands.put(command)

    def _sink(self, rid: str, inbox: Inbox) -> Callable[[Any], None]:
        loop = asyncio.get_running_loop()

        def deliver(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(inbox.put, item)
            except RuntimeError:  # the caller's loop is closed: nobody is listening
                self._do(lambda: self._abandon(rid))

        return deliver

    def _check_running(self, aborted_at: float | None) -> None:
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("native engine step thread is not running")
        if aborted_at is not None and time.monotonic() - aborted_at > _REPLY_TIMEOUT_S:
            raise RuntimeError("native engine did not confirm an abort in time")

    async def _call(self, fn: Callable, *args: Any) -> Any:
        """Run `fn(*args)` on the step thread and return its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def command() -> None:
            try:
                future.set_result(fn(*args))
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)

        self._do(command)
        async with asyncio.timeout(_REPLY_TIMEOUT_S):
            return await asyncio.wrap_future(future)

    # ---- the step thread

    def _shutdown(self) -> None:
        self._end_all()
        self._stopping = True

    def _run(self) -> None:
        core = self._core
        while not self._stopping:
            self._run_commands(block=not core.has_work or core.stalled)
            counted_at = time.monotonic()
            core.expire_handoffs()
            self._deliver(self._step() if core.has_work else [], counted_at)

    def _run_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(block=block, timeout=self._idle_timeout() if block else None)
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
