"""KVTransferAgent: one per worker; holds blocks for peers and moves blocks to and from them.

    agent = KVTransferAgent("prefill-0", KVMemory.native(engine.kv_cache, model), TransferConfig("nixl"))
    await agent.start()

Prefill (pull mode):
    desc = agent.hold(rid, block_ids, num_tokens, on_release)   # thread-safe, returns at once
    on_release(rid, reason, payload) fires exactly once: DONE when the decode side finished reading, ERROR when
    it reported a failure, EXPIRED when the lease ran out, CANCELLED on agent.release(rid) or close().
    The worker frees its engine blocks in on_release, whatever the reason.
Decode (pull mode):
    await agent.pull(desc, local_block_ids, skip_prefix_blocks=n)
    local_block_ids are the blocks the decode engine allocated for the request's blocks
    [n, ceil(num_tokens / block_size)); n prefix blocks it already has are not read. Layouts that
    differ are converted. On any exception the caller frees local_block_ids itself; the agent has
    already told the holder (Finish(ok=False)) so the prefill side frees its blocks too.
Push mode (SGLang style):
    decode:  desc = agent.hold(rid, reserved_ids, num_tokens, on_release, block_offset=n, writable=True)
             await agent.reserve(prefill_endpoint, desc)          # tell the prefill side where to write
    prefill: desc = await agent.wait_push_target(rid, timeout)    # the Reserve may come before or after
             await agent.push(desc, local_block_ids, payload=b"...")  # all of the request's blocks
    decode's on_release gets DONE and the payload once the blocks are filled (keep them), anything
    else: free them. The prefill caller frees its own blocks after push returns or raises.

Peer pull (a prefix a peer has, read instead of recomputed):
    holder:  agent.prefix_source = ...      # pins and unpins cached blocks by hash (PrefixSource)
    puller:  pulled = await agent.pull_prefix(holder_endpoint, rid, hashes, local_block_ids, skip_blocks=n)
    The holder pins the longest prefix of the hashes it holds (or refuses, PeerBusyError) under a hold whose
    lease is the transfer timeout, so a puller that dies leaves no pin behind; pulled.blocks says how far the
    prefix now goes in local_block_ids (the holder may have had fewer blocks than asked).

on_release runs on the agent's event loop, or in the thread that called release().
`agent.counters()` says what it moved (each side of a transfer counts it once: the initiator, and the holder
from the byte count the initiator's Finish carries) and why hand-offs failed, for a worker's /metrics.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
import numpy as np

from kv_transfer.layout import block_regions
from kv_transfer.memory import STAGING, KVMemory
from kv_transfer.plan import pull_plan, push_plan
from kv_transfer.protocol import (
    Begin, BlocksFreedError, CompatError, Fetch, Finish, GetMetadata, HoldPrefix, LeaseExpiredError, Pack,
    PeerBusyError, PeerLostError, ReleaseReason, Reply, Request, Reserve, TransferDescriptor, TransferError,
    Write, raise_for,
)
from kv_transfer.config import TransferConfig
from kv_transfer.side_channel import SideChannelClient, SideChannelServer, max_message_bytes
from kv_transfer.transports import ByteSink, block_frames, make_transport, stream_frames, to_the_end

log = logging.getLogger(__name__)

OnRelease = Callable[[str, ReleaseReason, bytes], None]  # (request id, why, the peer's Finish payload)
_ENDED_MEMORY = 4096  # recently ended holds remembered, to tell "expired" from "freed"
MAX_RESERVED = 4096  # push mode: unclaimed Reserves kept at once; more are refused
_SWEEP_S = 0.02
_desc_encoder = msgspec.msgpack.Encoder()
_desc_decoder = msgspec.msgpack.Decoder(TransferDescriptor)
# Why a hand-off failed here. As the initiator (a pull or push this side ran, or a push rendezvous): by the
# error it raised; as the holder: how a hold ended other than DONE (hold_error: the peer reported a failure).
FAILURE_REASONS = ("compat", "lease_expired", "blocks_freed", "peer_lost", "transfer_error", "cancelled",
                   "hold_expired", "hold_error", "hold_cancelled")
_ERROR_REASONS = ((CompatError, "compat"), (LeaseExpiredError, "lease_expired"),
                  (BlocksFreedError, "blocks_freed"), (PeerLostError, "peer_lost"),
                  (asyncio.CancelledError, "cancelled"))


@dataclass
class Moved:
    """Finished transfers one way: how many, their bytes and their seconds (Begin to Finish)."""

    count: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass
class PeerPulls:
    """Prefixes read from peers (this side pulling) and held for them (this side holding)."""

    pulled: int = 0  # pulls that ended well
    bytes: int = 0
    seconds: float = 0.0  # HoldPrefix to the end of the read
    refused: int = 0  # the holder was busy
    failed: int = 0  # any other failure (the prefix is recomputed)
    served: int = 0  # prefixes this side pinned for a peer
    declined: int = 0  # HoldPrefix requests this side refused as busy


@dataclass(frozen=True)
class PrefixPull:
    """What one peer pull did."""

    blocks: int  # leading blocks of the prefix the puller now has (its own skipped ones included)
    nbytes: int
    hold_s: float  # the HoldPrefix round trip: a pull's fixed cost
    pull_s: float  # moving the bytes


class PrefixSource(Protocol):
    """What pins prefixes for peers: an engine's cached blocks, by router.hashing's sequence hashes."""

    async def pin(self, pin_id: str, block_hashes: list[int]) -> list[int] | None:
        """Reference the blocks holding the longest prefix of `block_hashes` ([] if none); None: busy."""

    def unpin(self, pin_id: str) -> None:
        """Drop what `pin` took (from any thread; nothing when it took nothing)."""


@dataclass(frozen=True)
class AgentCounters:
    """What an agent has moved and what went wrong, since it started."""

    transport: str
    moved: dict[str, Moved]  # "in": KV written into this side's blocks (its pulls, peers' pushes); "out"
    failures: dict[str, int]  # FAILURE_REASONS -> count
    malformed_requests: int  # side-channel messages its server dropped or refused as unreadable
    malformed_replies: int  # side-channel replies its client dropped as unreadable
    nixl_agents_torn_down: int | None  # NIXL agents destroyed as a transfer would not end; None: not NIXL
    peer: PeerPulls = field(default_factory=PeerPulls)


@dataclass
class _Hold:
    desc: TransferDescriptor
    on_release: OnRelease
    deadline: float  # time.monotonic()
    pinned: bool = False
    begun: float = 0.0  # time.perf_counter() at the peer's Begin
    cancelled: bool = False
    cleanups: list[Callable[[], None]] = field(default_factory=list)  # packed copies peers may still read
    busy: int = 0  # Fetch / Pack / Write copies touching the blocks now (the side channel serves concurrently)
    ending: tuple[ReleaseReason, bytes] | None = None  # ended while busy: the last copy releases it


class KVTransferAgent:
    def __init__(self, engine_id: str, memory: KVMemory, config: TransferConfig | None = None):
        self.engine_id = engine_id
        self.memory = memory
        self.config = config or TransferConfig()
        self._max_bytes = max_message_bytes(memory.layout.num_blocks, self.config.frame_bytes)
        self._client = SideChannelClient(max_bytes=self._max_bytes, guard=self.config.guard)
        self.transport = make_transport(memory, engine_id, self._client, self.config)
        self._holds: dict[str, _Hold] = {}
        self._ended: OrderedDict[str, ReleaseReason] = OrderedDict()
        self._lock = threading.Lock()
        self._server: SideChannelServer | None = None
        self._sweeper: asyncio.Task | None = None
        self._push_targets: dict[str, asyncio.Future] = {}  # push mode: request id -> Reserve's target
        self._reserved_until: dict[str, float] = {}  # unclaimed Reserves: request id -> local expiry (monotonic)
        self._abandoned: OrderedDict[str, None] = OrderedDict()  # push mode: rooms the prefill stopped waiting on
        self._moved = {"in": Moved(), "out": Moved()}
        self._failures = dict.fromkeys(FAILURE_REASONS, 0)
        self._peer = PeerPulls()
        self.prefix_source: PrefixSource | None = None  # set by a worker that lends its prefixes to peers

    @property
    def endpoint(self) -> str:
        if self._server is None:
            raise RuntimeError("KVTransferAgent.start() has not run")
        return self._server.endpoint

    async def start(self) -> KVTransferAgent:
        default = f"inproc://kv-{self.engine_id}" if self.config.transport == "inproc" else "tcp://127.0.0.1:0"
        self._server = SideChannelServer(self.config.endpoint or default, self._handle, max_bytes=self._max_bytes,
                                         guard=self.config.guard, advertise_host=self.config.advertise_host)
        self._server.start()
        await self.transport.start(self._server.endpoint)
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        return self

    async def close(self) -> None:
        for rid in list(self._holds):
            self._end(rid, ReleaseReason.CANCELLED)
        if self._sweeper:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        await self._client.close()
        if self._server:
            await self._server.close()
        await self.transport.close()

    def counters(self) -> AgentCounters:
        with self._lock:
            moved = {way: Moved(m.count, m.bytes, m.seconds) for way, m in self._moved.items()}
            failures = dict(self._failures)
            peer = PeerPulls(**vars(self._peer))
        server_malformed = self._server.malformed if self._server else 0
        return AgentCounters(self.transport.name, moved, failures, server_malformed, self._client.malformed,
                             getattr(self.transport, "torn_down", None), peer)

    def _count_moved(self, way: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            moved = self._moved[way]
            moved.count += 1
            moved.bytes += nbytes
            moved.seconds += seconds

    def _count_failure(self, exc: BaseException) -> None:
        reason = next((name for kind, name in _ERROR_REASONS if isinstance(exc, kind)), "transfer_error")
        with self._lock:
            self._failures[reason] += 1

    async def __aenter__(self) -> KVTransferAgent:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- holding ------------------------------------------------------------------------------

    def hold(self, request_id: str, block_ids: Sequence[int], num_tokens: int, on_release: OnRelease, *,
             block_offset: int = 0, writable: bool = False, lease_s: float | None = None) -> TransferDescriptor:
        """Keep `block_ids` (the request's blocks from `block_offset` on) for a peer to read (or,
        writable, to fill) until it finishes or the lease runs out; returns what the peer needs."""
        layout = self.memory.layout
        needed = math.ceil(num_tokens / layout.block_size) - block_offset
        if num_tokens <= 0 or block_offset < 0 or len(block_ids) != needed:
            raise ValueError(
                f"hold {request_id!r}: {len(block_ids)} blocks from block {block_offset} do not match "
                f"{num_tokens} tokens at block size {layout.block_size} (need {needed})"
            )
        if any(b < 0 or b >= layout.num_blocks for b in block_ids):
            raise ValueError(f"hold {request_id!r}: block id outside [0, {layout.num_blocks}): {list(block_ids)}")
        lease = lease_s or self.config.lease_s
        desc = TransferDescriptor(
            engine_id=self.engine_id, request_id=request_id, transport=self.transport.name,
            endpoint=self.endpoint, agent_name=self.transport.agent_name, layout=layout,
            compat_hash=layout.compat_hash(), base_addrs=self.memory.base_addrs(),
            mem_type=self.memory.mem_type, device_id=self.memory.device_id, block_ids=list(block_ids),
            num_tokens=num_tokens, block_offset=block_offset, writable=writable,
            lease_deadline=time.time() + lease,
        )
        with self._lock:
            if request_id in self._holds:
                raise ValueError(f"request {request_id!r} already holds blocks")
            self._ended.pop(request_id, None)
            self._holds[request_id] = _Hold(desc, on_release, time.monotonic() + lease)
        return desc

    def release(self, request_id: str) -> bool:
        """Give up a hold locally (request aborted). A transfer in flight finishes first; the peer then
        gets BlocksFreedError. Returns False when nothing was held."""
        with self._lock:
            hold = self._holds.get(request_id)
            if hold is None:
                return False
            if hold.pinned:  # the peer is reading or writing these blocks right now
                hold.cancelled = True
                return True
        return self._end(request_id, ReleaseReason.CANCELLED)

    def holding(self) -> list[str]:
        """Request ids whose blocks are held right now."""
        with self._lock:
            return list(self._holds)

    def _end(self, request_id: str, reason: ReleaseReason, payload: bytes = b"") -> bool:
        with self._lock:
            hold = self._holds.pop(request_id, None)
            if hold is None:
                return False
            self._ended[request_id] = reason
            if reason is not ReleaseReason.DONE:
                self._failures[f"hold_{reason.value}"] += 1
            while len(self._ended) > _ENDED_MEMORY:
                self._ended.popitem(last=False)
            if hold.busy:  # a copy still reads or writes the blocks: they are released once it is done
                hold.ending = (reason, payload)
                return True
        self._release(request_id, hold, reason, payload)
        return True

    def _release(self, request_id: str, hold: _Hold, reason: ReleaseReason, payload: bytes) -> None:
        for cleanup in hold.cleanups:
            cleanup()
        try:
            hold.on_release(request_id, reason, payload)
        except Exception:
            log.exception("on_release(%r, %s) raised", request_id, reason)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(_SWEEP_S)
            now = time.monotonic()
            with self._lock:
                expired = [rid for rid, h in self._holds.items() if h.deadline < now]
            for rid in expired:
                self._end(rid, ReleaseReason.EXPIRED)
            for rid, until in list(self._reserved_until.items()):  # Reserves nobody came for
                if until < now:
                    del self._reserved_until[rid]
                    self._push_targets.pop(rid, None)

    def _missing(self, request_id: str) -> Reply:
        reason = self._ended.get(request_id)
        if reason is ReleaseReason.EXPIRED:
            return Reply(False, "expired", f"the lease on {request_id!r} at {self.engine_id} ran out")
        what = f"ended ({reason.value})" if reason else "never held"
        return Reply(False, "freed", f"{self.engine_id} holds no blocks for {request_id!r}: {what}")

    async def _handle(self, request: Request, frames: list, send) -> Reply:
        """The holder's side of the protocol (runs on the side channel)."""
        if isinstance(request, GetMetadata):
            return Reply(True, payload=self.transport.metadata())
        if isinstance(request, Reserve):
            return self._reserve(request)
        if isinstance(request, HoldPrefix):
            return await self._hold_prefix(request)
        with self._lock:
            hold = self._holds.get(request.request_id)
        if hold is not None and hold.deadline < time.monotonic():  # expired, the sweeper not yet by
            self._end(request.request_id, ReleaseReason.EXPIRED)
            hold = None
        if hold is None:
            return self._missing(request.request_id)
        if isinstance(request, Begin):
            if request.compat_hash != hold.desc.compat_hash:
                self._end(request.request_id, ReleaseReason.ERROR)
                return Reply(False, "compat", f"compat hash {request.compat_hash} != {hold.desc.compat_hash}")
            if hold.pinned:
                return Reply(False, "freed", f"{request.request_id!r} is already being transferred")
            hold.pinned, hold.begun = True, time.perf_counter()
            # The peer's timeout is capped by ours (and NaN, negative or huge ones replaced by it).
            took = request.timeout_s if 0 < request.timeout_s < self.config.timeout_s else self.config.timeout_s
            hold.deadline = time.monotonic() + took + self.config.timeout_s
            return Reply(True)
        if isinstance(request, Finish):
            reason = ReleaseReason.DONE if request.ok else ReleaseReason.ERROR
            if hold.cancelled:
                self._end(request.request_id, ReleaseReason.CANCELLED)
                return Reply(False, "freed", f"{request.request_id!r} was cancelled at {self.engine_id}")
            if not request.ok:
                log.warning("peer failed transfer of %r: %s", request.request_id, request.message)
            elif hold.pinned:  # bytes moved (a Finish without Begin: the peer had every block already)
                self._count_moved("in" if hold.desc.writable else "out", request.nbytes,
                                  time.perf_counter() - hold.begun)
            self._end(request.request_id, reason, request.payload)
            return Reply(True)
        if not hold.pinned:
            return Reply(False, "bad_request", f"{type(request).__name__} before Begin for {request.request_id!r}")
        if not set(request.block_ids) <= set(hold.desc.block_ids):
            return Reply(False, "bad_request", f"blocks {request.block_ids} are not held for {request.request_id!r}")
        if isinstance(request, Write) and not hold.desc.writable:
            return Reply(False, "bad_request", f"blocks of {request.request_id!r} are not writable")
        with self._lock:
            hold.busy += 1
        try:
            return await self._copy(request, frames, send, hold)
        finally:
            with self._lock:
                hold.busy -= 1
                ending = hold.ending if hold.busy == 0 else None
            if ending is not None:
                self._release(request.request_id, hold, *ending)

    async def _hold_prefix(self, request: HoldPrefix) -> Reply:
        """Pin what the engine has of a prefix and hold it for the peer, leased for one transfer timeout."""
        source, rid = self.prefix_source, request.request_id
        if source is None:
            return Reply(False, "bad_request", f"{self.engine_id} lends no prefixes to peers")
        with self._lock:
            taken = rid in self._holds
        if taken:
            return Reply(False, "bad_request", f"{rid!r} is already held at {self.engine_id}")
        blocks = await source.pin(rid, request.block_hashes)
        if blocks is None:
            with self._lock:
                self._peer.declined += 1
            return Reply(False, "busy", f"{self.engine_id} is too busy to hold a prefix for a peer")
        if not blocks:
            return Reply(False, "freed", f"{self.engine_id} holds none of that prefix")
        try:
            desc = self.hold(rid, blocks, len(blocks) * self.memory.layout.block_size,
                             lambda *_: source.unpin(rid), lease_s=self.config.timeout_s)
        except ValueError as exc:
            source.unpin(rid)
            return Reply(False, "bad_request", str(exc))
        with self._lock:
            self._peer.served += 1
        return Reply(True, payload=_desc_encoder.encode(desc))

    def _reserve(self, request: Reserve) -> Reply:
        rid, target = request.request_id, request.target
        if target.request_id != rid or not target.writable:
            return Reply(False, "bad_request", f"Reserve for {rid!r} carries no writable target for it")
        if rid in self._abandoned:  # tell the decode side now, not when its lease ends
            return Reply(False, "expired", f"{self.engine_id} stopped waiting to push {rid!r}")
        room = self._push_target(rid)
        if room.done():
            return Reply(False, "bad_request", f"blocks for {rid!r} were already reserved")
        if len(self._reserved_until) >= MAX_RESERVED:
            return Reply(False, "bad_request", f"{self.engine_id} has {MAX_RESERVED} unclaimed reservations")
        room.set_result(target)
        # Kept until the peer's lease ends, but never longer than this side's own bound.
        left = target.lease_deadline - time.time()
        self._reserved_until[rid] = time.monotonic() + (left if left < self.config.reserve_s else self.config.reserve_s)
        return Reply(True)

    async def _copy(self, request: Fetch | Pack | Write, frames: list, send, hold: _Hold) -> Reply:
        rows = block_regions(self.memory.layout, np.asarray(request.block_ids))
        if isinstance(request, Fetch):
            frames, buffer = await asyncio.to_thread(block_frames, self.memory, request.block_ids, rows,
                                                     self.config.frame_bytes)
            if buffer is not None:  # zero-copy frames read it until the peer's Finish
                hold.cleanups.append(lambda: STAGING.give(buffer))
            await stream_frames(frames, send)
        elif isinstance(request, Pack):
            nbytes = int(rows[:, 2].sum())
            buffer = STAGING.take(nbytes)
            await asyncio.to_thread(self.memory.gather, request.block_ids, buffer[:nbytes])
            metadata, unexpose = self.transport.expose(buffer)
            hold.cleanups.append(lambda: (unexpose(), STAGING.give(buffer)))
            return Reply(True, payload=buffer.data_ptr().to_bytes(8, "little") + metadata)
        elif isinstance(request, Write):
            sink = ByteSink(self.memory, request.block_ids, rows)
            await asyncio.to_thread(lambda: (sink.write_frames(frames), sink.finish()))
        return Reply(True)

    # -- moving -------------------------------------------------------------------------------

    async def pull(self, desc: TransferDescriptor, local_block_ids: Sequence[int], skip_prefix_blocks: int = 0,
                   timeout_s: float | None = None) -> int:
        """Read the blocks of `desc` that this side lacks into `local_block_ids`; returns bytes moved."""
        if desc.writable:
            raise ValueError(f"descriptor for {desc.request_id!r} is a push target; call push()")
        return await self._transfer(
            desc, timeout_s, lambda: pull_plan(desc, self.memory, local_block_ids, skip_prefix_blocks), reading=True
        )

    async def push(self, desc: TransferDescriptor, local_block_ids: Sequence[int],
                   timeout_s: float | None = None, payload: bytes = b"") -> int:
        """Write this side's blocks (all of the request's, from block 0) into the blocks `desc` reserved;
        the holder's on_release gets `payload` with DONE."""
        if not desc.writable:
            raise ValueError(f"descriptor for {desc.request_id!r} is not a push target; call pull()")
        return await self._transfer(desc, timeout_s, lambda: push_plan(desc, self.memory, local_block_ids),
                                    reading=False, payload=payload)

    async def pull_prefix(self, endpoint: str, request_id: str, block_hashes: Sequence[int],
                          local_block_ids: Sequence[int], skip_blocks: int = 0,
                          timeout_s: float | None = None) -> PrefixPull:
        """Read from the agent at `endpoint` what it holds of the prefix `block_hashes` past the `skip_blocks`
        this side has, into `local_block_ids` (blocks [skip_blocks, len(block_hashes)) of the prefix). Raises
        PeerBusyError when the holder refuses, else as pull(); the holder unpins whatever happens."""
        timeout = timeout_s or self.config.timeout_s
        started = time.perf_counter()
        try:
            try:
                asked = HoldPrefix(request_id, list(block_hashes))
                reply = raise_for(await self._client.call(endpoint, asked, timeout))
            except PeerLostError:
                self._client.forget(endpoint)
                raise
            desc = _desc_decoder.decode(reply.payload)
            hold_s = time.perf_counter() - started
            held = len(desc.block_ids)
            if held <= skip_blocks:  # nothing this side lacks: let the holder unpin now
                await self._finish(desc, True, "nothing to read", timeout)
                return PrefixPull(skip_blocks, 0, hold_s, 0.0)
            nbytes = await self.pull(desc, local_block_ids[:held - skip_blocks],
                                     skip_prefix_blocks=skip_blocks, timeout_s=timeout)
        except BaseException as exc:
            with self._lock:
                if isinstance(exc, PeerBusyError):
                    self._peer.refused += 1
                else:
                    self._peer.failed += 1
            raise
        seconds = time.perf_counter() - started
        with self._lock:
            self._peer.pulled += 1
            self._peer.bytes += nbytes
            self._peer.seconds += seconds
        return PrefixPull(held, nbytes, hold_s, seconds - hold_s)

    # -- push-mode rendezvous ---------------------------------------------------------------------

    def _push_target(self, request_id: str) -> asyncio.Future:
        if request_id not in self._push_targets:
            self._push_targets[request_id] = asyncio.get_running_loop().create_future()
        return self._push_targets[request_id]

    async def reserve(self, endpoint: str, target: TransferDescriptor, timeout_s: float | None = None) -> None:
        """Decode side: tell the agent at `endpoint` that `target` (a writable hold) waits for its push."""
        if not target.writable:
            raise ValueError(f"descriptor for {target.request_id!r} is not a push target")
        try:
            raise_for(await self._client.call(endpoint, Reserve(target.request_id, target),
                                              timeout_s or self.config.timeout_s))
        except BaseException as exc:
            self._count_failure(exc)
            if isinstance(exc, PeerLostError):
                self._client.forget(endpoint)
            raise

    async def wait_push_target(self, request_id: str, timeout_s: float) -> TransferDescriptor:
        """Prefill side: the descriptor the decode side reserved for `request_id` (sent before or after)."""
        target = self._push_target(request_id)
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(target)
        except asyncio.TimeoutError:
            lost = PeerLostError(f"no decode side reserved blocks for {request_id!r} within {timeout_s:.1f}s")
            self._count_failure(lost)
            raise lost from None
        finally:
            self._push_targets.pop(request_id, None)
            self._reserved_until.pop(request_id, None)
            if not target.done():  # timed out or cancelled: a late Reserve is refused at once
                self._abandoned[request_id] = None
                while len(self._abandoned) > _ENDED_MEMORY:
                    self._abandoned.popitem(last=False)

    async def _transfer(self, desc: TransferDescriptor, timeout_s: float | None, make_plan, reading: bool,
                        payload: bytes = b"") -> int:
        start = time.perf_counter()
        try:
            nbytes = await self._move(desc, timeout_s, make_plan, reading, payload)
        except BaseException as exc:
            self._count_failure(exc)
            raise
        if nbytes:
            self._count_moved("in" if reading else "out", nbytes, time.perf_counter() - start)
        return nbytes

    async def _move(self, desc: TransferDescriptor, timeout_s: float | None, make_plan, reading: bool,
                    payload: bytes) -> int:
        timeout = timeout_s or self.config.timeout_s
        try:
            if desc.transport != self.transport.name:
                raise TransferError(f"descriptor uses {desc.transport}, this agent {self.transport.name}")
            problem = desc.layout.convertible(self.memory.layout)
            if desc.compat_hash != self.memory.layout.compat_hash():
                problem = problem or f"compat hash {desc.compat_hash} != {self.memory.layout.compat_hash()}"
            if problem:
                raise CompatError(f"{desc.request_id!r} from {desc.engine_id}: {problem}")
            if desc.lease_deadline < time.time():
                raise LeaseExpiredError(f"the lease on {desc.request_id!r} at {desc.engine_id} ran out")
            plan, finish = await asyncio.to_thread(make_plan)  # a push may convert layouts here
        except (TransferError, ValueError) as e:
            await self._finish(desc, False, str(e), timeout)  # let the holder free its blocks now
            raise
        if plan is None:  # every block already cached on the reading side
            raise_for(await self._client.call(desc.endpoint, Finish(desc.request_id, True, payload=payload), timeout))
            return 0
        try:
            begun = await self._client.call(desc.endpoint, Begin(desc.request_id, desc.compat_hash, timeout), timeout)
        except PeerLostError:
            self._client.forget(desc.endpoint)
            raise
        except asyncio.CancelledError:  # the holder may have pinned the blocks: unpin them now, not at its deadline
            await asyncio.shield(self._finish(desc, False, "cancelled", timeout))
            raise
        raise_for(begun)
        try:
            if reading:
                await self.transport.read(desc, plan, timeout)
            else:
                await self.transport.write(desc, plan, timeout)
            # In the try: cancelled before this Finish went out, the holder must still hear one.
            done = await self._client.call(desc.endpoint, Finish(desc.request_id, True, payload=payload,
                                                                 nbytes=plan.nbytes), timeout)
        except BaseException as e:  # a second Finish after a delivered one is answered "freed", harmlessly
            await asyncio.shield(self._finish(desc, False, f"{type(e).__name__}: {e}", timeout))
            raise
        raise_for(done)
        if finish is not None:
            await to_the_end(asyncio.to_thread(finish))
        return plan.nbytes

    async def _finish(self, desc: TransferDescriptor, ok: bool, message: str, timeout: float) -> None:
        try:
            await self._client.call(desc.endpoint, Finish(desc.request_id, ok, message), min(timeout, 2.0))
        except TransferError as e:  # the holder is gone or unreachable; its lease frees the blocks
            log.info("Finish(%r) not delivered: %s", desc.request_id, e)
            self._client.forget(desc.endpoint)
