"""KV events in: engine hashes translated to the project's, sequence numbers checked per worker.

An engine names blocks in its own hash space (vLLM: sha256 bytes or ints, any seed). The project
re-hashes each BlockStored's `token_ids` with router.hashing, chaining from the project hash of the
event's parent (looked up through this worker's map engine-hash -> project sequence hash), so the
indexer works whatever hash an engine uses. An engine that already uses the project's hashes
(the native engine) costs no map entries: a hash that equals its project twin is not stored.
A worker that says at registration that it publishes the project's hashes (WorkerInfo.kv_project_hashes)
is `trust`ed: its int hashes are indexed as they come, its token_ids never decoded nor re-hashed.

`deliver(worker, seq, payload)` enforces order: the next sequence number is applied, an older one
is a duplicate (replay overlap) and is skipped, a newer one is a GAP and nothing is applied.
A live stream whose sequence goes back is a restarted engine: its old state is dropped.
`follow(worker, source)` feeds a transport's stream (a `BatchSource`, e.g. dynamo_pd.runtime.kv_events)
through `deliver` and recovers: a gap asks the source's replay for the missing batches; without
replay, or when the replay no longer reaches back, the worker is reset and rebuilt from what follows.
Never silently wrong: every event that cannot be applied exactly is skipped and counted in `stats`;
the indexer then under-reports (a block is missing), never over-reports.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import msgspec

from router.events import (
    DEVICE_MEDIA,
    LOWER_TIERS,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    KVEvent,
    ProjectBlockStored,
    decode_for_ingest,
    stored_tokens,
)
from router.hashing import chained_block_hashes, salt_root
from router.indexer import IndexerSnapshot, KvIndexer, WorkerId

log = logging.getLogger(__name__)

QUIET_CATCH_UP_S = 1.0  # a replayable stream silent this long checks the replay buffer for missed batches
Batch = tuple[int, bytes]  # (sequence number, msgpack KVEventBatch)
Replay = Callable[[int], Awaitable[list[Batch] | None]]  # batches from a sequence number on; None: it failed


class BatchSource(Protocol):
    """One worker's event batches as a transport delivers them."""

    replay: Replay | None  # None: the transport cannot replay

    async def next(self, timeout_s: float | None) -> Batch | None:
        """The next batch, or None when none came within `timeout_s`."""


class Delivery(enum.Enum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"
    GAP = "gap"


class IngestStats(msgspec.Struct):
    batches: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    clears: int = 0
    duplicates: int = 0
    gaps: int = 0
    resets: int = 0  # worker state dropped (gap without replay, engine restart)
    unknown_parent: int = 0  # BlockStored whose parent this worker never stored: skipped
    rejected: int = 0  # BlockStored with a block size or token count that does not fit: skipped
    unknown_events: int = 0  # event kinds (or a block's medium) we do not know: skipped
    lower_stored: int = 0  # blocks stored in a lower tier (host, disk)
    lower_removed: int = 0


class _WorkerState:
    __slots__ = ("last_seq", "last_live", "engine_to_project")

    def __init__(self) -> None:
        self.last_seq: int | None = None  # last batch applied
        self.last_live: int | None = None  # last batch seen on the live stream
        self.engine_to_project: dict[BlockHash, int] = {}


class IngestSnapshot(msgspec.Struct, frozen=True):
    indexer: IndexerSnapshot
    last_seq: dict[WorkerId, int | None]
    engine_to_project: dict[WorkerId, list[tuple[BlockHash, int]]]


class EventIngestor:
    def __init__(self, indexer: KvIndexer, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.indexer = indexer
        self.block_size = block_size
        self.stats = IngestStats()
        self._workers: dict[WorkerId, _WorkerState] = {}
        self._trusted: set[WorkerId] = set()

    def trust(self, worker: WorkerId, trusted: bool = True) -> None:
        """Index `worker`'s int block hashes as they come: it publishes the project's own (router.hashing)."""
        if trusted:
            self._trusted.add(worker)
        else:
            self._trusted.discard(worker)

    def expected_seq(self, worker: WorkerId) -> int | None:
        """The next sequence number `worker` should send; None before its first batch."""
        state = self._workers.get(worker)
        return None if state is None or state.last_seq is None else state.last_seq + 1

    def deliver(self, worker: WorkerId, seq: int, payload: bytes, live: bool = True) -> Delivery:
        """Apply one batch if it is the next; `live` batches come from the PUB stream, others from replay."""
        state = self._workers.get(worker)
        if state is None:
            state = self._workers[worker] = _WorkerState()
        if live and state.last_live is not None and seq <= state.last_live:
            # PUB/SUB keeps order, so a live stream that goes back is a restarted engine
            log.warning(
                "worker %s restarted its event stream (seq %d after %d): dropping its state",
                worker,
                seq,
                state.last_live,
            )
            self.reset_worker(worker)
            state = self._workers[worker]
        last = state.last_seq
        if last is not None and seq != last + 1:
            if seq > last:
                self.stats.gaps += 1
                return Delivery.GAP
            self.stats.duplicates += 1  # replay and live stream overlap
            delivery = Delivery.DUPLICATE
        else:
            batch, unknown = decode_for_ingest(payload, worker in self._trusted)
            self.stats.unknown_events += unknown
            self.apply_events(worker, batch.events)
            state.last_seq = seq
            self.stats.batches += 1
            delivery = Delivery.APPLIED
        if live:
            state.last_live = seq
        return delivery

    async def follow(self, worker: WorkerId, source: BatchSource) -> None:
        """Apply `source`'s batches in order until cancelled. With replay, a late joiner first fetches what
        came before, and a quiet stream checks the buffer: a gap shows only when a later batch arrives, so
        batches sent while a subscription was forming (ZMQ's slow joiner) or the last of a burst lost on
        the way are found then, not at the next event."""
        replay = source.replay
        if replay is not None:
            await self.catch_up(worker, replay)
        while True:
            batch = await source.next(QUIET_CATCH_UP_S if replay is not None else None)
            if batch is None:
                await self.catch_up(worker, replay)
                continue
            seq, payload = batch
            try:
                if self.deliver(worker, seq, payload) is not Delivery.GAP:
                    continue
                log.warning("worker %s: KV event batches %d..%d missing", worker, self.expected_seq(worker),
                            seq - 1)
                if not await self.catch_up(worker, replay) or \
                        self.deliver(worker, seq, payload) is Delivery.GAP:
                    self.reset_worker(worker)
                    self.deliver(worker, seq, payload)
            except EventDecodeError as exc:  # a batch we cannot read is a batch we missed
                log.error("worker %s: undecodable KV event batch %d (%s): dropping its state", worker, seq,
                          exc)
                self.reset_worker(worker)

    async def catch_up(self, worker: WorkerId, replay: Replay | None) -> bool:
        """Apply what `replay` holds from the next expected batch on (rebuilding from its first batch when it
        no longer reaches back that far); False when there is no replay or it failed."""
        batches = None if replay is None else await replay(self.expected_seq(worker) or 0)
        if batches is None:
            return False
        for seq, payload in batches:
            try:
                if self.deliver(worker, seq, payload, live=False) is Delivery.GAP:
                    log.warning("worker %s: replay buffer starts at %d, after the missing batch %s: rebuilding "
                                "its state from there", worker, seq, self.expected_seq(worker))
                    self.reset_worker(worker)
                    self.deliver(worker, seq, payload, live=False)
            except EventDecodeError as exc:
                log.error("worker %s: undecodable replayed batch %d (%s): dropping its state", worker, seq,
                          exc)
                self.reset_worker(worker)
        return True

    def reset_worker(self, worker: WorkerId) -> None:
        """Drop everything known about `worker`; the events that follow rebuild it."""
        self.stats.resets += 1
        self.indexer.clear_worker(worker)
        self._workers[worker] = _WorkerState()

    def remove_worker(self, worker: WorkerId) -> None:
        self.indexer.remove_worker(worker)
        self._workers.pop(worker, None)
        self._trusted.discard(worker)

    def apply_events(self, worker: WorkerId, events: list[KVEvent]) -> None:
        """Apply decoded events in order (no sequence check: `deliver` does that)."""
        state = self._workers.get(worker)
        if state is None:
            state = self._workers[worker] = _WorkerState()
        for event in events:
            if type(event) is ProjectBlockStored and event.medium is None:  # the hot path, inline: a trusted
                # worker's device blocks, their hashes as they are
                if event.block_size != self.block_size:
                    self._reject(worker, event, -1)
                elif self.indexer.store(worker, event.block_hashes, after=event.parent_block_hash):
                    self.stats.blocks_stored += len(event.block_hashes)
                else:
                    self.stats.unknown_parent += 1
            elif not isinstance(event, AllBlocksCleared) and event.medium not in DEVICE_MEDIA:
                self._lower(worker, state, event)
            elif isinstance(event, BlockStored):
                self._store(worker, state, event)
            elif isinstance(event, BlockRemoved):
                to_project = state.engine_to_project
                hashes = event.block_hashes
                self.indexer.remove(worker, [to_project.pop(h, h) for h in hashes] if to_project else hashes)
                self.stats.blocks_removed += len(hashes)
            elif isinstance(event, AllBlocksCleared):
                self.indexer.clear_worker(worker)
                state.engine_to_project.clear()
                self.stats.clears += 1

    def _lower(self, worker: WorkerId, state: _WorkerState, event: BlockStored | BlockRemoved) -> None:
        """A lower tier's store or removal: by hash (engine hashes through this worker's map), no parent."""
        tier = event.medium
        if tier not in LOWER_TIERS:
            self.stats.unknown_events += 1  # a medium we cannot place: never guessed to be a tier we know
            return
        to_project = state.engine_to_project
        hashes = [h for h in (to_project.get(h, h) for h in event.block_hashes) if isinstance(h, int)]
        if isinstance(event, BlockStored):
            self.indexer.store_lower(worker, tier, hashes)
            self.stats.lower_stored += len(hashes)
        else:
            self.indexer.remove_lower(worker, tier, hashes)
            self.stats.lower_removed += len(hashes)

    def _reject(self, worker: WorkerId, event: BlockStored, tokens: int) -> None:
        self.stats.rejected += 1
        log.warning("worker %s: BlockStored with block_size %d and %s tokens for %d blocks does not fit block "
                    "size %d: skipped", worker, event.block_size, tokens if tokens >= 0 else "its",
                    len(event.block_hashes), self.block_size)

    def _store(self, worker: WorkerId, state: _WorkerState, event: BlockStored) -> None:
        size = self.block_size
        count = len(event.block_hashes)
        tokens = stored_tokens(event)
        if event.block_size != size or len(tokens) != count * size:
            self._reject(worker, event, len(tokens))
            return
        parent_hash = event.parent_block_hash
        if parent_hash is None:
            parent = salt_root(event.lora_name)
        else:
            parent = state.engine_to_project.get(parent_hash)
            if parent is None:
                if isinstance(parent_hash, int) and self.indexer.holds(worker, parent_hash):
                    parent = parent_hash  # the engine uses the project's own hashes
                else:
                    self.stats.unknown_parent += 1
                    return
        project = chained_block_hashes(tokens, size, parent)
        to_project = state.engine_to_project
        for engine_hash, project_hash in zip(event.block_hashes, project):
            if engine_hash != project_hash:
                to_project[engine_hash] = project_hash
        self.indexer.store(worker, project)
        self.stats.blocks_stored += count

    def dump(self) -> IngestSnapshot:
        return IngestSnapshot(
            indexer=self.indexer.dump(),
            last_seq={w: s.last_seq for w, s in self._workers.items()},
            engine_to_project={w: list(s.engine_to_project.items()) for w, s in self._workers.items()},
        )

    def restore(self, snapshot: IngestSnapshot) -> None:
        self.indexer.restore(snapshot.indexer)
        self._workers = {}
        for worker, last in snapshot.last_seq.items():
            state = self._workers[worker] = _WorkerState()
            state.last_seq = last
            state.engine_to_project = dict(snapshot.engine_to_project.get(worker, ()))
