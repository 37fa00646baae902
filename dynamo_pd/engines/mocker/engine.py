"""MockerEngine: MockerCore behind the async Engine contract, on the caller's event loop.

    python -m dynamo_pd.serve --engine mocker --speedup 10          # a whole deployment of mockers
    python -m dynamo_pd.mocker --workers 16 --role aggregated       # 16 mocker workers in one process

No model runs, so no thread is needed: one asyncio task per engine schedules a batch, waits out the
time the profile gives it on a clock (real, or a fake one in tests), then delivers its outputs; a step
it is behind on (sped up past a turn of the loop) runs at once, up to _BURST_S of steps a turn.
Commands (new requests, aborts, finished KV loads) that arrive meanwhile run before the next step,
as the native engine's step thread runs them; the request life (sinks, generate, aborts, KV loads)
is the native engine's too (engines/native/driver.py). Many engines share one loop, so many workers share
one process. Engine flags: `--profile PATH` (a JSON Profile; default: Llama-3.1-8B on one H100,
see profile.py), `--speedup X` (simulated time runs X times faster). `--kv-cache-memory-gb` is the
simulated GPU's KV memory (an 8B model on one 80 GB H100 leaves about 54 GB for KV).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from dynamo_pd.engines.base import EngineConfig, KVLoader
from dynamo_pd.engines.mocker.core import MockerCore
from dynamo_pd.engines.mocker.profile import Profile, h100_llama8b
from dynamo_pd.engines.native.driver import CoreDriver, LoadOrder
from dynamo_pd.protocol import EngineRequest
from dynamo_pd.runtime.tasks import cancel_and_wait

log = logging.getLogger(__name__)

_OPTIONS = {"profile", "speedup"}
# Back to back, a step starts when the one before was due to end, so the timer's rounding (uvloop's: a whole
# ms, up or down) and this loop's own work are made up and steps take the profile's time on average; a step
# that starts later than this after its predecessor's due time (a stall) is not made up.
_CATCH_UP_S = 0.005
# Behind the profile's time (a step sped up past a turn of this process's loop: 35 us at --speedup 200, where a
# turn with four busy engines takes ~1.7 ms), steps run back to back without giving the loop a turn, for up to
# this much real time; one step a turn made such a mocker decode ~50x slower than its profile.
_BURST_S = 0.001


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


class MockerEngine(CoreDriver):
    def __init__(self, config: EngineConfig, kv_loader: KVLoader | None = None, clock: Clock | None = None):
        super().__init__(config, kv_loader)
        unknown = sorted(set(config.extra) - _OPTIONS)
        if unknown:
            raise ValueError(f"unknown mocker option(s) {', '.join(unknown)}: "
                             f"it takes --profile PATH and --speedup X")
        self.speedup = float(config.extra.get("speedup", 1.0))
        if not self.speedup > 0:
            raise ValueError(f"--speedup must be positive, got {config.extra['speedup']!r}")
        self.profile = Profile.load(config.extra["profile"]) if "profile" in config.extra else h100_llama8b()
        self.clock = clock or Clock()
        self._task: asyncio.Task | None = None
        self._commands: list[Callable[[], None]] = []
        self._wake: asyncio.Event | None = None

    # ---- lifecycle

    async def start(self) -> None:
        if self._task is not None:
            return
        self._core = await asyncio.to_thread(MockerCore, self.config, self.profile, self.speedup)
        await asyncio.to_thread(self._core.grammars.compiler)  # grammar.py's Grammars: why before serving
        self.stats = self._core.stats()
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is None:
            return
        self._end_all()  # the loop waits (a step, or for work) and is cancelled before it runs again
        self.stats = self._core.stats()
        await cancel_and_wait([self._task])
        self._task = None
        self._core.close()

    def _core_or_raise(self) -> MockerCore:
        if self._task is None:
            raise RuntimeError("MockerEngine is not started: await engine.start() first")
        return self._core

    # ---- what workers and kv_transfer read (and CoreDriver's tokenizer, kv_cache, ...)

    async def release_handoff(self, request_id: str) -> None:
        self._core_or_raise().release_handoff(request_id)  # held blocks are in no batch: safe mid-step
        self._wake.set()

    async def pin_prefix(self, pin_id: str, hashes: list[int]) -> list[int] | None:
        return self._core_or_raise().pin_prefix(pin_id, hashes)  # cached blocks: safe to pin mid-step

    # ---- requests: CoreDriver.generate, on this loop

    def _check_running(self, aborted_at: float | None) -> None:
        if self._task is None or self._task.done():
            raise RuntimeError("mocker engine loop is not running")

    async def _after_load(self, request: EngineRequest, order: LoadOrder) -> None:
        # The stand-in KV has moved; the profiled model's KV takes this long on the profiled link.
        moved = max(0, request.handoff.num_tokens - order.cached_blocks * self.config.block_size)
        await self.clock.sleep(self.profile.transfer_s(moved) / self.speedup)

    async def _after_prefix_load(self, num_blocks: int) -> float:
        # the stand-in KV has moved; the profiled model's blocks take this long on the profiled link
        seconds = self.profile.transfer_s(num_blocks * self.config.block_size) / self.speedup
        await self.clock.sleep(seconds)
        return seconds

    # ---- the engine loop (commands and steps)

    def _do(self, command: Callable[[], None]) -> None:
        self._commands.append(command)
        self._wake.set()

    async def _run(self) -> None:
        core = self._core
        due = float("-inf")  # when the last step was due to end
        turn = time.monotonic()  # when this task last gave the loop a turn
        while True:
            busy = bool(self._commands) or (core.has_work and not core.stalled)  # no wait: back to back
            await self._wait_for_work()
            if not busy:
                turn = time.monotonic()
            commands, self._commands = self._commands, []
            counted_at = time.monotonic()  # real time, as the routers reading the stats keep it
            for command in commands:
                try:
                    command()
                except Exception:  # a bad command must not stop the engine
                    log.exception("mocker engine command failed")
            core.expire_handoffs()
            outputs = []
            started, stepped = self.clock.now(), False
            if core.has_work:
                outputs = self._step()
                stepped = core.step_s > 0
                if stepped:  # the forward pass the profile gives this batch
                    due = (due if busy and started - due < _CATCH_UP_S else started) + core.step_s
                    delay = due - self.clock.now()
                    if delay > 0 or time.monotonic() - turn > _BURST_S:
                        await self.clock.sleep(delay)
                        turn = time.monotonic()
            self._deliver(outputs, counted_at)
            if stepped:
                core.step_taken(self.clock.now() - started)

    async def _wait_for_work(self) -> None:
        core = self._core
        if self._commands or (core.has_work and not core.stalled):
            return
        self._wake.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            async with asyncio.timeout(self._idle_timeout()):
                await self._wake.wait()
