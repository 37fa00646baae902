"""The KV hand-off: how a prompt's KV gets from the prefill worker to the decode worker. One place.

The kinds (`HeldKV`, `PullHandoff`, `PushHandoff`, `EngineHandoff`) are dynamo_pd.handoff_kinds's.

How the frontend dispatches is what the prefill worker registered (`WorkerInfo.handoff_offer`), never an
engine name: no offer -> send the decode request after the prefill's first output, with the hand-off that
output carries; an offer -> `offer.for_request(...)` goes to prefill and decode at once. Whose first token
the client gets is the hand-off's `first_token_from_decode`.

Peer prefixes (any role of an engine that lends them, Engine.peer_prefixes): the manager lends the engine's
cached prefixes to peers through its agent (they pin and read them, kv_transfer's HoldPrefix) and is the
engine's prefix_loader, reading the prefix a request's kv_prefix names from the peer that holds it.

Times: every lease and timeout of a hand-off comes from HandoffTimes (the user's --handoff-lease-s and the
KV transfer timeout) and `together_timeouts` (the frontend's first-response bound).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from dynamo_pd import tracing
from dynamo_pd.handoff_kinds import EngineHandoff, Handoff, HeldKV, PullHandoff, PushHandoff, TransferStats
from dynamo_pd.protocol import EngineOutput, EngineRequest, WorkerInfo
from kv_transfer.config import TransferConfig
from kv_transfer.protocol import ReleaseReason, TransferError
from kv_transfer.side_channel import Guard, Plain
from router.hashing import block_hashes

if TYPE_CHECKING:  # imported in start(): see there
    from kv_transfer.agent import KVTransferAgent, PrefixPull

log = logging.getLogger("dynamo_pd.handoff")
_encoder = msgspec.msgpack.Encoder()


@dataclass(frozen=True)
class HandoffTimes:
    """Every lease and timeout of a hand-off, from the user's --handoff-lease-s and the transfer timeout.

    A pull hold ends by its lease, or later by the one transfer it was pinned for: the holder keeps
    pinned blocks for the reader's timeout (capped by its own) plus its own (kv_transfer.agent, Begin).
    The engine's own lease is only the backstop for a release that never comes: it outlasts that."""

    lease_s: float = 30.0  # --handoff-lease-s: how long held KV waits for the decode side
    transfer_timeout_s: float = TransferConfig.timeout_s  # longest silence from a peer in one transfer

    def __post_init__(self) -> None:
        if not (self.lease_s > 0 and self.transfer_timeout_s > 0):
            raise ValueError(f"hand-off lease and transfer timeout must be positive: {self}")

    @property
    def hold_s(self) -> float:
        """The longest a pull hold can last: the worker waits this long for its release."""
        return self.lease_s + 2 * self.transfer_timeout_s

    @property
    def engine_lease_s(self) -> float:
        """PREFILL engine: frees held blocks itself after this (the agent has released them by then)."""
        return self.hold_s + self.transfer_timeout_s

    @property
    def drain_s(self) -> float:
        """DECODE, push: a write in flight may go on this long after the hold is given up."""
        return 2 * self.transfer_timeout_s

    def reserve_lease_s(self, handoff: PushHandoff) -> float:
        """DECODE, push: reserved blocks wait for the prefill's bound, then the usual lease."""
        return handoff.wait_s + self.lease_s

    def load_timeout_s(self, handoff: Handoff) -> float:
        """DECODE engine: the longest its kv_loader may take."""
        return self.lease_s + (handoff.wait_s if isinstance(handoff, PushHandoff | EngineHandoff) else 0.0)

    def transfer_config(self, transport: str) -> TransferConfig:
        return TransferConfig(transport, lease_s=self.lease_s, timeout_s=self.transfer_timeout_s)


@dataclass(frozen=True)
class _Moved:
    """DECODE: what one request's KV load moved, until its first output carries `stats` (and its trace a
    kv_transfer span: the blocks, the mode and when it ended are this side's own)."""

    stats: TransferStats
    blocks: int
    mode: str  # pull, push
    ended_ns: int  # wall clock


def together_timeouts(first_response_s: float) -> tuple[float, float]:
    """Frontend, an offered hand-off: (how long the decode side waits for the prefill's KV, how long the
    frontend waits for the decode stream's first output) from its own first-response bound."""
    return first_response_s, 2 * first_response_s


class HandoffManager:
    """One per worker: its side of every hand-off, and the only user of its KV transfer agent.

    PREFILL: an engine output's HeldKV becomes a PullHandoff (the agent holds the blocks; the stream stays
    open until the decode side has read them, so a caller that goes away frees them at once), or, when the
    request came with a PushHandoff, a push into the blocks the decode side reserved. DECODE: `load_kv` is
    the engine's kv_loader. Engines that move KV themselves get no agent; their hand-offs are stamped with
    the worker id and passed on."""

    def __init__(self, worker_id: str, times: HandoffTimes, transport: str = "zmq", offer_push: bool = False, *,
                 host: str = "127.0.0.1", advertise_host: str = "", guard: Guard = Plain()):
        self.worker_id, self.times, self._transport, self._offer_push = worker_id, times, transport, offer_push
        # where the agent's side channel binds, the address peers reach it at, how its sockets are secured
        self._place = dict(endpoint=f"tcp://{host}:0", advertise_host=advertise_host, guard=guard)
        self.agent: KVTransferAgent | None = None
        self._engine: Any = None
        self._moved: dict[str, _Moved] = {}  # DECODE: request id -> what its load moved

    async def start(self, engine: Any, model_name: str) -> None:
        """After the engine started: an agent over its KV cache when the engine's KV is ours to move."""
        self._engine = engine
        if engine.kv_handoffs:
            # here, not at the top: the frontend imports this module (together_timeouts) without torch
            from kv_transfer.agent import KVTransferAgent
            from kv_transfer.memory import KVMemory

            memory = KVMemory.native(engine.kv_cache, model_name)
            config = dataclasses.replace(self.times.transfer_config(self._transport), **self._place)
            self.agent = KVTransferAgent(self.worker_id, memory, config)
            await self.agent.start()
            if getattr(engine, "peer_prefixes", False) and engine.config.peer_prefixes:  # it can, and may
                self.agent.prefix_source = _EnginePrefixes(engine)
                engine.prefix_loader = self.load_prefix

    async def close(self) -> None:
        if self.agent is not None:
            await self.agent.close()

    async def lend_while_draining(self, handed: int) -> int:
        """Draining: `handed` requests were just cut for migration, and their new workers may read the KV they
        computed here (the frontend offers it, router.consider_peer). Wait until that many prefixes were lent
        and every one returned, or a transfer timeout passed with none coming; returns how many were lent."""
        prefixes = self.agent.prefix_source if self.agent is not None else None
        if not isinstance(prefixes, _EnginePrefixes) or not handed:
            return 0
        loop = asyncio.get_running_loop()
        start, deadline = prefixes.lent, loop.time() + self.times.transfer_timeout_s
        while prefixes.lent - start < handed or prefixes.out:
            prefixes.changed.clear()
            if prefixes.out:  # a read in flight ends by its own lease, whatever happens to the reader
                deadline = max(deadline, loop.time() + self.times.transfer_timeout_s)
            try:
                async with asyncio.timeout_at(deadline):
                    await prefixes.changed.wait()
            except asyncio.TimeoutError:
                break
        return prefixes.lent - start

    def register(self, info: WorkerInfo) -> WorkerInfo:
        """What decode workers and the frontend need: the KV layout, the agent's endpoint, the offer."""
        if self.agent is None:
            return msgspec.structs.replace(info, handoff_offer=self._engine.handoff_offer())
        push = PushHandoff(worker_id=self.worker_id, peer_endpoint=self.agent.endpoint) if self._offer_push else None
        return msgspec.structs.replace(info, kv_layout=_encoder.encode(self.agent.memory.layout),
                                       kv_endpoint=self.agent.endpoint, handoff_offer=push,
                                       kv_peer_prefixes=self.agent.prefix_source is not None)

    async def serve(self, request: EngineRequest, outputs: AsyncIterator[EngineOutput],
                    trace: Any = None) -> AsyncIterator[EngineOutput]:
        """The engine's outputs for `request`, with its hand-off done; returns once it has ended. Every
        path gives the engine's held blocks back: a pull hold through its on_release, else here. `trace`
        (dynamo_pd.tracing): the parent of its kv_hold, kv_push or kv_transfer span."""
        rid = request.request_id
        held = False  # the engine holds this request's prompt KV for us
        released: asyncio.Event | None = None
        pushing: asyncio.Task | None = None
        holding = tracing.NOOP
        firsts: dict[int, int] = {}  # choice -> its first token (a push sends every choice's)
        try:
            async for out in outputs:
                if out.token_ids:
                    firsts.setdefault(out.index, out.token_ids[0])
                handoff = out.handoff
                if isinstance(handoff, HeldKV):
                    held = True
                    if isinstance(request.handoff, PushHandoff):
                        out.handoff = request.handoff
                        # while the token streams
                        tokens = [firsts[i] for i in sorted(firsts)]
                        pushing = asyncio.create_task(self._push(handoff, tokens, trace))
                    else:
                        released, out.handoff = self._hold(handoff)
                        blocks = {"dynamo_pd.kv.blocks": len(handoff.block_ids)}
                        holding = tracing.start("kv_hold", trace, blocks)  # until the decode side read them
                elif isinstance(handoff, EngineHandoff):
                    handoff.worker_id = self.worker_id
                moved = self._moved.pop(rid, None)
                out.transfer = None if moved is None else moved.stats
                if moved is not None and trace is not None:
                    self._trace_transfer(moved, trace)
                yield out
            if released is not None:
                async with asyncio.timeout(self.times.engine_lease_s):
                    await released.wait()
            if pushing is not None:
                await pushing  # bounded: the rendezvous by the lease, the push by the transfer timeout
        finally:
            tracing.end(holding)
            self._moved.pop(rid, None)
            if pushing is not None and not pushing.done():
                # A task cancelled before its first step never runs its body: the blocks are freed below.
                pushing.cancel()
                await asyncio.gather(pushing, return_exceptions=True)
            if released is not None:
                if not released.is_set():
                    self.agent.release(rid)  # on_release frees them, after a transfer in flight ends
            elif held:  # pushed, failed, cancelled, or the hold refused
                await asyncio.shield(self._engine.release_handoff(rid))

    def _hold(self, held: HeldKV) -> tuple[asyncio.Event, PullHandoff]:
        engine, loop = self._engine, asyncio.get_running_loop()
        released = asyncio.Event()

        def on_release(request_id: str, reason: ReleaseReason, _payload: bytes) -> None:
            if reason is not ReleaseReason.DONE:
                log.info("hand-off of %s ended: %s", request_id, reason.value)

            def free() -> None:
                released.set()
                asyncio.ensure_future(engine.release_handoff(request_id))

            loop.call_soon_threadsafe(free)

        desc = self.agent.hold(held.request_id, held.block_ids, held.num_tokens, on_release)
        return released, PullHandoff(descriptor=desc, worker_id=self.worker_id)

    async def _push(self, held: HeldKV, first_token_ids: list[int], trace: Any = None) -> None:
        """PREFILL, push: write the prompt's KV and the first tokens (one per choice) into the blocks the decode
        side reserved for this request id; `serve` frees the engine's blocks once this has ended."""
        rid = held.request_id
        span = tracing.start("kv_push", trace, {"dynamo_pd.kv.transport": self.agent.transport.name,
                                                "dynamo_pd.kv.blocks": len(held.block_ids)})
        try:
            target = await self.agent.wait_push_target(rid, self.times.lease_s)
            span.add_event("reserved")  # the decode side's blocks are known: the write starts
            # The decode side times the transfer from this stamp; both ends share a host clock or NTP.
            nbytes = await self.agent.push(target, held.block_ids,
                                           payload=_encoder.encode((first_token_ids, time.time())))
            span.set_attribute("dynamo_pd.kv.bytes", nbytes)
        except Exception as exc:  # noqa: BLE001 - the decode side sees the failure (ERROR or its lease)
            log.warning("push of %s failed: %s", rid, exc)
            tracing.end(span, exc)
        finally:
            tracing.end(span)

    def _trace_transfer(self, moved: _Moved, trace: Any) -> None:
        """DECODE: the KV transfer's span, recorded when the first output carries its figures."""
        nbytes, seconds = moved.stats.nbytes, moved.stats.seconds
        span = tracing.start("kv_transfer", trace, {
            "dynamo_pd.kv.transport": self.agent.transport.name, "dynamo_pd.kv.mode": moved.mode,
            "dynamo_pd.kv.blocks": moved.blocks, "dynamo_pd.kv.bytes": nbytes,
            "dynamo_pd.kv.seconds": seconds,
            "dynamo_pd.kv.gb_per_s": nbytes / seconds / 1e9 if seconds > 0 else 0.0,
        }, start_ns=moved.ended_ns - int(seconds * 1e9))
        tracing.end(span, end_ns=moved.ended_ns)

    async def load_kv(self, handoff: Handoff, local_block_ids: list[int],
                      cached_blocks: int) -> list[int] | None:
        """DECODE: the engine's kv_loader. Fills `local_block_ids` past the `cached_blocks` it has; returns
        the first tokens (one per choice) when they came with the KV (push), else None."""
        if isinstance(handoff, PushHandoff):
            return await self._receive_push(handoff, local_block_ids, cached_blocks)
        if not isinstance(handoff, PullHandoff):
            raise TypeError(f"a {type(handoff).__name__} is not loaded through the KV transfer agent")
        start = time.perf_counter()
        moved = await self.agent.pull(handoff.descriptor, local_block_ids[cached_blocks:],
                                      skip_prefix_blocks=cached_blocks)
        self._moved[handoff.request_id] = _Moved(TransferStats(moved, time.perf_counter() - start),
                                                 len(local_block_ids) - cached_blocks, "pull", time.time_ns())
        return None

    async def load_prefix(self, request: EngineRequest, local_block_ids: list[int],
                          cached_blocks: int) -> PrefixPull:
        """Any role that computes a prompt: the engine's prefix_loader. Reads the prefix request.kv_prefix
        names from the peer that holds it into `local_block_ids` (the prefix's blocks from block 0), past the
        `cached_blocks` the engine has."""
        size = self.agent.memory.layout.block_size
        tokens = request.prompt_token_ids + request.resume_token_ids
        hashes = block_hashes(tokens[:len(local_block_ids) * size], size, request.cache_salt)
        hold_id = f"{request.request_id}@{self.worker_id}"
        return await self.agent.pull_prefix(request.kv_prefix.endpoint, hold_id, hashes,
                                            local_block_ids[cached_blocks:], skip_blocks=cached_blocks)

    async def _receive_push(self, handoff: PushHandoff, local_block_ids: list[int],
                            cached_blocks: int) -> list[int]:
        """DECODE, push: reserve the blocks this worker lacks, tell the prefill worker where they are,
        and wait until it has filled them; returns the first tokens it sent along (one per choice)."""
        rid, loop = handoff.request_id, asyncio.get_running_loop()
        ended: asyncio.Future = loop.create_future()

        def on_release(request_id: str, reason: ReleaseReason, payload: bytes) -> None:
            loop.call_soon_threadsafe(lambda: ended.done() or ended.set_result((reason, payload)))

        blocks = local_block_ids[cached_blocks:]
        target = self.agent.hold(rid, blocks, handoff.num_tokens, on_release, block_offset=cached_blocks,
                                 writable=True, lease_s=self.times.reserve_lease_s(handoff))
        try:
            await self.agent.reserve(handoff.peer_endpoint, target)
            reason, payload = await ended
        finally:
            # A push in flight keeps writing these blocks until its Finish: wait for it before the
            # engine may free them.
            if self.agent.release(rid) and not ended.done():
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    async with asyncio.timeout(self.times.drain_s):
                        await asyncio.shield(ended)
        if reason is not ReleaseReason.DONE:
            raise TransferError(f"push of {rid!r} from {handoff.worker_id} ended: {reason.value}")
        first_token_ids, started = msgspec.msgpack.decode(payload)
        seconds = max(0.0, time.time() - started)
        stats = TransferStats(len(blocks) * self.agent.memory.layout.block_bytes, seconds)
        self._moved[rid] = _Moved(stats, len(blocks), "push", time.time_ns())
        return first_token_ids


class _EnginePrefixes:
    """The engine's cached prefixes lent to peers (kv_transfer.agent.PrefixSource), counted."""

    def __init__(self, engine: Any):
        self._engine = engine
        self._loop = asyncio.get_running_loop()
        self.lent = 0  # prefixes pinned for a peer so far
        self.out: set[str] = set()  # pinned now
        self.changed = asyncio.Event()  # set whenever a prefix is returned

    async def pin(self, pin_id: str, block_hashes: list[int]) -> list[int] | None:
        blocks = await self._engine.pin_prefix(pin_id, block_hashes)
        if blocks:
            self.lent += 1
            self.out.add(pin_id)
        return blocks

    def unpin(self, pin_id: str) -> None:
        self._engine.unpin_prefix(pin_id)
        self._loop.call_soon_threadsafe(self._returned, pin_id)

    def _returned(self, pin_id: str) -> None:
        self.out.discard(pin_id)
        self.changed.set()
