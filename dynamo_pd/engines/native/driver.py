"""CoreDriver: an EngineCore's request life behind the async Engine contract.

NativeEngine runs its core on a step thread, MockerEngine its MockerCore in an asyncio task; both
drive it the same way, and this is that way: a request is added with a delivery sink, its outputs
are emitted to it, it ends or is aborted, a DECODE request's KV is loaded through `kv_loader`, a prefix a peer
holds (request.kv_prefix) is read through `prefix_loader` before the rest is computed (recomputed when
that read fails), and `generate` waits for each item with cancellation. Only the core's loop touches
the core and the sinks: callers reach it through `_do`. Subclasses say how a command reaches that loop
(`_do`) and an output a request (`_sink`), how a waiting request learns that the loop stopped
(`_check_running`), and run the loop, which calls `_step` and `_deliver`.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from dynamo_pd.engines.base import Engine, EngineConfig, EngineRole, KVLoader
from dynamo_pd.engines.native.core import EngineCore, EngineStats
from dynamo_pd.guided import KINDS
from dynamo_pd.protocol import EngineOutput, EngineRequest
from dynamo_pd.runtime import RequestContext
from dynamo_pd.runtime.inbox import Inbox
from router.events import KVEvent

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

    from kv_transfer.agent import PrefixPull

# Read request.kv_prefix from its peer into the request's blocks past the ones the engine has (block ids of
# the whole prefix, how many it has); raises on failure (dynamo_pd.handoff.HandoffManager.load_prefix).
PrefixLoader = Callable[[EngineRequest, list[int], int], Awaitable["PrefixPull"]]

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.5  # how often an idle core loop wakes (lease expiry, shutdown)


@dataclass
class LoadOrder:
    """DECODE role: blocks are reserved; the request's consumer must fill them. `prefix`: instead, the
    blocks of the prefix a peer holds (any role), read before the rest of the request is computed."""

    block_ids: list[int]
    cached_blocks: int
    prefix: bool = False


class CoreDriver(Engine):
    kv_handoffs = ("pull", "push")
    resumes = True  # EngineCore.add_request continues resume_token_ids
    project_hashes = True  # the block manager names blocks by router.hashing (sequence.full_block_hashes)
    guided_kinds = KINDS  # the sampler applies every kind's grammar (native/grammar.py)
    forks = logit_bias = prompt_logprobs = True  # the core forks choices; its sampler biases and scores prompts
    peer_prefixes = True  # lends cached prefixes to peers (pin_prefix) and reads theirs (prefix_loader)

    def __init__(self, config: EngineConfig, kv_loader: KVLoader | None):
        if config.role is EngineRole.DECODE and kv_loader is None:
            raise ValueError(f"a DECODE {type(self).__name__} needs a kv_loader to import prompt KV")
        self.config = config
        self.role = config.role
        self.kv_loader = kv_loader
        self.stats = EngineStats()
        self._core: EngineCore | None = None
        self._sinks: dict[str, Callable[[Any], None]] = {}  # request id -> delivery to its generator
        self.prefix_loader: PrefixLoader | None = None  # set by the worker that lends it its KV agent

    @abc.abstractmethod
    def _core_or_raise(self) -> EngineCore: ...

    @abc.abstractmethod
    def _do(self, command: Callable[[], None]) -> None:
        """Run `command` on the core's loop, before its next step."""

    def _sink(self, rid: str, inbox: Inbox) -> Callable[[Any], None]:
        """How the core's loop delivers to a request's generator (here: they share the event loop)."""
        return inbox.put

    @abc.abstractmethod
    def _check_running(self, aborted_at: float | None) -> None:
        """Raise RuntimeError if the core's loop has stopped (or has not confirmed an abort sent at
        `aborted_at` in time): a request waiting for its next item checks this every IDLE_POLL_S."""

    async def _receive(self, inbox: Inbox, context: RequestContext, aborted_at: float | None) -> Any:
        """The request's next item; None when the context was cancelled first (its cancel wakes the wait)."""
        while not inbox.items:
            if context.cancelled and aborted_at is None:
                return None
            self._check_running(aborted_at)
            await inbox.wait(IDLE_POLL_S)
        return inbox.items.pop(0)

    async def _after_load(self, request: EngineRequest, order: LoadOrder) -> None:
        """Called once kv_loader has filled the blocks, before the core learns of it."""

    async def _after_prefix_load(self, num_blocks: int) -> float:
        """Called once prefix_loader has read `num_blocks` blocks; returns seconds it adds to the read."""
        return 0.0

    def unpin_prefix(self, pin_id: str) -> None:
        """A peer's read of a pinned prefix ended (from the agent's loop or thread)."""
        self._do(lambda: self._core.unpin_prefix(pin_id))

    # ---- what workers and kv_transfer read

    @property
    def tokenizer(self):
        return self._core_or_raise().tokenizer

    @property
    def max_model_len(self) -> int:
        return self._core_or_raise().max_model_len

    @property
    def kv_cache(self) -> torch.Tensor:
        """[layers, 2 (K, V), blocks, block_size, kv_heads, head_dim], one contiguous tensor (the
        mocker's is a stand-in in this layout: 1 layer, 1 head of 4 floats holding token ids)."""
        return self._core_or_raise().kv_cache

    def drain_kv_events(self) -> list[KVEvent]:
        """KV events since the last call, in order (safe from any thread)."""
        return self._core_or_raise().block_manager.drain_events()

    def observe_steps(self, observer: Callable[[float, int], None]) -> bool:
        # the seconds the step cost meter sees: the mocker's are its profile's, scaled by --speedup
        self._core_or_raise().step_costs.observer = lambda load, seconds: observer(seconds, load.sequences)
        return True

    # ---- requests (on the caller's loop)

    async def generate(self, request: EngineRequest, context: RequestContext) -> AsyncIterator[EngineOutput]:
        core = self._core_or_raise()
        core.check_request(request)
        guided, grammar = request.sampling.guided, None
        if guided is not None:  # compiled here, off the core's loop: a new schema takes ~0.2 s
            grammar = await asyncio.to_thread(core.grammars.compile, guided)
        rid = request.request_id
        inbox = Inbox()
        deliver = self._sink(rid, inbox)
        self._do(lambda: self._add(request, deliver, grammar))
        done, aborted_at = False, None
        forget_cancel = context.on_cancel(inbox.wake)
        try:
            while True:
                if context.cancelled and aborted_at is None:
                    aborted_at = time.monotonic()
                    self._do(lambda: self._end_request(rid, "abort"))
                item = await self._receive(inbox, context, aborted_at)
                if item is None:
                    continue  # cancelled while waiting: abort at the top of the loop
                if isinstance(item, BaseException):
                    done = True  # rejected before it started (e.g. a duplicate id): nothing to abort
                    raise item
                if isinstance(item, LoadOrder):
                    if aborted_at is None:
                        await (self._load_prefix if item.prefix else self._load)(request, item)
                    continue
                done = item.ends
                yield item
                if done:
                    return
        finally:
            forget_cancel()
            if not done:  # the consumer closed the stream or was cancelled before the final output
                self._do(lambda: self._abandon(rid))

    async def _load(self, request: EngineRequest, order: LoadOrder) -> None:
        rid = request.request_id
        try:
            async with asyncio.timeout(self.config.handoff.load_timeout_s(request.handoff)):
                first_token_ids = await self.kv_loader(request.handoff, order.block_ids, order.cached_blocks)
            await self._after_load(request, order)
        except Exception as exc:  # noqa: BLE001 - any loader failure ends this request, not the engine
            message = f"KV load for {rid!r} failed: {exc!r}"
            self._do(lambda: self._end_request(rid, "error", message))
            return
        self._do(lambda: self._emit_all(self._core.finish_load(rid, first_token_ids)))

    async def _load_prefix(self, request: EngineRequest, order: LoadOrder) -> None:
        """Read the prefix a peer holds; whatever of it did not arrive is computed (never an error)."""
        rid, core = request.request_id, self._core
        blocks, observe = order.cached_blocks, None
        try:
            async with asyncio.timeout(self.config.handoff.hold_s):
                pulled = await self.prefix_loader(request, order.block_ids, order.cached_blocks)
            moved = pulled.blocks - order.cached_blocks
            extra_s = await self._after_prefix_load(moved) if moved > 0 else 0.0
            if moved > 0:
                meter, nbytes = core.fetch_costs.pull, moved * core.fetch_costs.block_bytes
                observe = lambda: meter.observe(nbytes, pulled.pull_s + extra_s, pulled.hold_s)  # noqa: E731
            blocks = pulled.blocks
        except Exception as exc:  # noqa: BLE001 - a peer that fails, refuses or dies: computed here instead
            log.info("prefix of %r from %s not read (%r): computed here", rid, request.kv_prefix.worker_id,
                     exc)

        def done() -> None:
            if observe is not None:
                observe()
            core.finish_prefix_load(rid, blocks)

        self._do(done)

    # ---- the core's loop

    def _add(self, request: EngineRequest, deliver: Callable[[Any], None],
             grammar: CompiledGrammar | None) -> None:
        try:
            self._core.add_request(request, grammar, peer_loads=self.prefix_loader is not None)
        except Exception as exc:  # noqa: BLE001 - the caller raises it
            deliver(exc)
            return
        self._sinks[request.request_id] = deliver

    def _emit(self, out: EngineOutput | None) -> None:
        if out is None:
            return
        deliver = self._sinks.pop(out.request_id) if out.ends else self._sinks.get(out.request_id)
        if deliver is not None:
            deliver(out)

    def _emit_all(self, outputs: list[EngineOutput]) -> None:
        for out in outputs:
            self._emit(out)

    def _end_request(self, rid: str, reason: str, error: str | None = None) -> None:
        self._emit(self._core.end_request(rid, reason, error))

    def _abandon(self, rid: str) -> None:
        """Nobody will take `rid`'s final output: abort it, and free the blocks it holds for a hand-off
        when it finished as prefill_done first (its HeldKV sat undelivered, so no one else frees them)."""
        self._end_request(rid, "abort")
        self._core.release_handoff(rid)

    def _end_all(self) -> None:
        """Stopping: abort every request and give back every held hand-off."""
        for rid in list(self._core.seqs):
            self._end_request(rid, "abort")
        for rid in list(self._core.held):
            self._core.release_handoff(rid)
        for pin_id in list(self._core.pins):
            self._core.unpin_prefix(pin_id)

    def _idle_timeout(self) -> float:
        """How long an idle loop may wait: IDLE_POLL_S, or less when a hand-off lease expires sooner."""
        timeout = IDLE_POLL_S
        if self._core.held:
            next_expiry = min(deadline for _, deadline in self._core.held.values())
            timeout = min(timeout, max(0.0, next_expiry - time.monotonic()))
        return timeout

    def _step(self) -> list[EngineOutput]:
        try:
            return self._core.step()
        except Exception as exc:  # fail the batch, keep serving
            log.exception("%s step failed", type(self).__name__)
            return self._core.fail_all(f"engine step failed: {exc!r}")

    def _deliver(self, outputs: list[EngineOutput], counted_at: float) -> None:
        """After a step: its outputs to their requests, then load orders to newly admitted DECODE ones.
        `counted_at`: when the commands before the step ran (EngineStats.counted_at)."""
        core = self._core
        # before delivery: a caller seeing an output sees stats after it
        self.stats = replace(core.stats(), counted_at=counted_at)
        self._emit_all(outputs)
        for seq in core.take_new_loads():
            if seq.peer_load:  # what it has (hits, tier copies) is computed already
                cached_blocks = seq.num_computed_tokens // core.block_manager.block_size
            else:
                cached_blocks = (seq.num_cached_tokens or 0) // core.block_manager.block_size
            self._sinks[seq.request_id](LoadOrder(list(seq.block_table), cached_blocks, prefix=seq.peer_load))
