"""The KV indexer: which worker holds which cached prefix blocks.

The radix tree over local block hashes is stored flat: a node is keyed by its *sequence* hash
(router.hashing), which names the whole path from the root, so the child of node p through local
hash l is simply `chain_hash(p, l)` and a lookup is one dict probe per block. Each node holds a
bitmask of the workers that cache the block (a worker owns one bit, its slot).

Membership is per block, as engines keep it: a worker matches the longest prefix whose blocks it
all holds, and evicting a block in the middle of a chain leaves the blocks after it in place; they
count again once the missing block is stored again.

What each worker holds is read from those bitmasks; per worker the indexer keeps only a count and a log
of the batches it stored (a reference each, no per-block work), which clear_worker walks. Removals leave
stale entries in the log; it is compacted once it holds more than twice the worker's blocks.

A batch's blocks go into the dict through `_add` and find_matches walks it through `_match`: router/_index.c
where the install compiled it (the ingest and routing hot paths), the same functions in Python otherwise, with
a warning.

Memory is bounded by `max_nodes` (0 = unbounded): at the bound, new blocks are not indexed and are
counted in `dropped_blocks`, so matches may under-report but never name a block a worker lacks.

Lower tiers (router.events.LOWER_TIERS: host, disk) are indexed beside the device tier, one dict of worker
bitmasks per tier on the same worker slots: a set of blocks per worker (no chain: the engine copies a block
back before a prefill, wherever it sits in the prompt). `lower_run` says how far a worker's prefix goes on
in them past its device overlap; snapshots (dump / restore) hold the device tier only.

API (all sync; call from one thread, the router's event loop):
    store(worker, seq_hashes) / remove(worker, seq_hashes) / clear_worker(worker) / remove_worker(worker)
    find_matches(seq_hashes) -> Overlaps, a Mapping {worker: leading blocks it holds} (workers with >= 1)
    store_lower / remove_lower(worker, tier, seq_hashes), lower_run(worker, seq_hashes, start) -> per tier
    dump() -> IndexerSnapshot / restore(snapshot) / memory() -> IndexerMemory
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from typing import Union

import msgspec
import numpy as np

from router.events import LOWER_TIERS

WorkerId = Union[str, int]


def _add_py(nodes: dict[int, int], batch: tuple[int, ...], bit: int) -> int:
    """Set `bit` in the mask of each block of `batch` (a new block gets `bit` alone); how many lacked it.
    router/_index.c is this function in C, built at install; this one runs where it was not built."""
    before = len(nodes)
    if nodes.keys().isdisjoint(batch):
        # usually every block is new to the index: one C-level update, no per-block Python
        nodes.update(zip(batch, repeat(bit)))
        return len(nodes) - before
    fresh = dict.fromkeys(batch, bit)
    new = len(fresh)
    for h in nodes.keys() & fresh.keys():
        mask = nodes[h]
        new -= mask & bit != 0
        fresh[h] = mask | bit
    nodes.update(fresh)
    return new


def _match_py(nodes: dict[int, int], seq_hashes: Sequence[int]) -> list[tuple[int, int]]:
    """The workers holding the first block, as (workers bitmask, blocks held in a row) levels: one level
    at each block where some of them stop holding, and the rest with the whole length. router/_index.c is
    this function in C, built at install; this one runs where it was not built."""
    levels: list[tuple[int, int]] = []
    alive = nodes.get(seq_hashes[0], 0) if seq_hashes else 0
    if not alive:
        return levels
    depth = 1
    for h in seq_hashes[1:]:
        still = alive & nodes.get(h, 0)
        if still != alive:
            levels.append((alive ^ still, depth))
            alive = still
            if not alive:
                return levels
        depth += 1
    levels.append((alive, depth))
    return levels


try:
    from router._index import add as _add, match as _match
except ImportError:
    _add, _match = _add_py, _match_py
    logging.getLogger(__name__).warning(
        "router._index is not built (no C compiler at install?): the KV indexer runs its Python store and "
        "match (slower event ingest and routing); reinstall with gcc and the Python headers to build it")


class IndexerSnapshot(msgspec.Struct, frozen=True):
    """Every worker's resident blocks (sequence hashes); msgpack-encodable."""

    workers: dict[WorkerId, list[int]]


class IndexerMemory(msgspec.Struct, frozen=True):
    nodes: int  # distinct blocks
    resident_blocks: int  # (worker, block) pairs
    workers: int
    dropped_blocks: int  # refused at the max_nodes bound
    approx_bytes: int  # upper bound: containers plus every int they hold, as if none were shared


class KvIndexer:
    def __init__(self, max_nodes: int = 0) -> None:
        if max_nodes < 0:
            raise ValueError(f"max_nodes must be >= 0 (0 = unbounded), got {max_nodes}")
        self.max_nodes = max_nodes
        self.dropped_blocks = 0
        self._nodes: dict[int, int] = {}  # seq hash -> bitmask of worker slots
        self._slot_of: dict[WorkerId, int] = {}
        self._worker_at: list[WorkerId | None] = []  # slot -> worker
        self._count: list[int] = []  # slot -> blocks held
        self._log: list[list[tuple[int, ...]]] = []  # slot -> batches stored (a superset of what it holds)
        self._logged: list[int] = []  # slot -> hashes in its log
        self._free_slots: list[int] = []
        self._lower: dict[str, dict[int, int]] = {}  # lower tier -> seq hash -> bitmask of worker slots
        self._lower_count: dict[tuple[str, int], int] = {}  # (tier, slot) -> blocks held there

    # -- workers ---------------------------------------------------------------------------------
    @property
    def workers(self) -> list[WorkerId]:
        return list(self._slot_of)

    def _slot(self, worker: WorkerId) -> int:
        slot = self._slot_of.get(worker)
        if slot is None:
            if self._free_slots:
                slot = self._free_slots.pop()
                self._worker_at[slot] = worker
            else:
                slot = len(self._worker_at)
                self._worker_at.append(worker)
                self._count.append(0)
                self._log.append([])
                self._logged.append(0)
            self._slot_of[worker] = slot
        return slot

    def _held(self, slot: int) -> list[int]:
        """The blocks `slot` holds, each once, from its log."""
        bit, nodes = 1 << slot, self._nodes
        return [h for h in dict.fromkeys(h for batch in self._log[slot] for h in batch) if nodes.get(h, 0) & bit]

    def clear_worker(self, worker: WorkerId) -> None:
        """Forget every block of `worker` (AllBlocksCleared, or state dropped after a gap)."""
        slot = self._slot_of.get(worker)
        if slot is None:
            return
        keep = ~(1 << slot)
        nodes = self._nodes
        for h in self._held(slot):
            mask = nodes[h] & keep
            if mask:
                nodes[h] = mask
            else:
                del nodes[h]
        self._count[slot] = self._logged[slot] = 0
        self._log[slot] = []
        bit = 1 << slot
        for tier, lower in self._lower.items():  # rare (a worker reset or gone): a scan is fine
            if self._lower_count.pop((tier, slot), 0):
                for h in [h for h, mask in lower.items() if mask & bit]:
                    mask = lower[h] & keep
                    if mask:
                        lower[h] = mask
                    else:
                        del lower[h]

    def remove_worker(self, worker: WorkerId) -> None:
        slot = self._slot_of.get(worker)
        if slot is None:
            return
        self.clear_worker(worker)
        del self._slot_of[worker]
        self._worker_at[slot] = None
        self._free_slots.append(slot)

    # -- events ----------------------------------------------------------------------------------
    def store(self, worker: WorkerId, seq_hashes: Iterable[int], after: int | None = None) -> bool:
        """Index `seq_hashes` as held by `worker`; with `after`, only if the worker holds that block (the
        parent of the chain they continue): False, and nothing stored, when it does not."""
        slot = self._slot_of.get(worker)
        if slot is None:
            if after is not None:
                return False
            slot = self._slot(worker)
        bit = 1 << slot
        nodes = self._nodes
        if after is not None and not nodes.get(after, 0) & bit:
            return False
        batch = seq_hashes if type(seq_hashes) is tuple else tuple(seq_hashes)
        bound = self.max_nodes
        if bound and len(nodes) + len(batch) > bound:
            new = 0
            for h in batch:
                mask = nodes.get(h)
                if mask is None and len(nodes) >= bound:
                    self.dropped_blocks += 1
                elif mask is None or not mask & bit:
                    nodes[h] = (mask or 0) | bit
                    new += 1
        else:
            new = _add(nodes, batch, bit)
        self._count[slot] += new
        self._log[slot].append(batch)
        self._logged[slot] += len(batch)
        self._compact_if_stale(slot)  # blocks stored again (a predicted cache re-stores a routed prefix)
        return True

    def remove(self, worker: WorkerId, seq_hashes: Iterable[int]) -> None:
        slot = self._slot_of.get(worker)
        if slot is None:
            return
        bit = 1 << slot
        keep = ~bit
        nodes = self._nodes
        gone = 0
        for h in seq_hashes:
            mask = nodes.get(h, 0)
            if mask & bit:
                gone += 1
                mask &= keep
                if mask:
                    nodes[h] = mask
                else:
                    del nodes[h]
        self._count[slot] -= gone
        self._compact_if_stale(slot)

    def _compact_if_stale(self, slot: int) -> None:
        """Rewrite the log as what the worker holds once it is mostly removed or repeated blocks (amortized:
        the log has grown by at least the worker's blocks since it was last rewritten)."""
        if self._logged[slot] > 2 * self._count[slot] + 1024:
            held = self._held(slot)
            self._log[slot] = [tuple(held)] if held else []
            self._logged[slot] = len(held)

    def holds(self, worker: WorkerId, seq_hash: int) -> bool:
        slot = self._slot_of.get(worker)
        return slot is not None and self._nodes.get(seq_hash, 0) >> slot & 1 == 1

    def blocks_of(self, worker: WorkerId) -> int:
        slot = self._slot_of.get(worker)
        return 0 if slot is None else self._count[slot]

    # -- lower tiers -----------------------------------------------------------------------------
    def store_lower(self, worker: WorkerId, tier: str, seq_hashes: Iterable[int]) -> None:
        """Index blocks `worker` now holds in lower tier `tier` (at the max_nodes bound, new ones drop)."""
        bit = 1 << self._slot(worker)
        lower = self._lower.setdefault(tier, {})
        bound, new = self.max_nodes, 0
        for h in seq_hashes:
            mask = lower.get(h)
            if mask is None and bound and len(lower) >= bound:
                self.dropped_blocks += 1
            elif mask is None or not mask & bit:
                lower[h] = (mask or 0) | bit
                new += 1
        key = (tier, self._slot_of[worker])
        self._lower_count[key] = self._lower_count.get(key, 0) + new

    def remove_lower(self, worker: WorkerId, tier: str, seq_hashes: Iterable[int]) -> None:
        slot = self._slot_of.get(worker)
        lower = self._lower.get(tier)
        if slot is None or lower is None:
            return
        bit, gone = 1 << slot, 0
        for h in seq_hashes:
            mask = lower.get(h, 0)
            if mask & bit:
                gone += 1
                if mask ^ bit:
                    lower[h] = mask ^ bit
                else:
                    del lower[h]
        if gone:
            self._lower_count[(tier, slot)] -= gone

    def lower_blocks_of(self, worker: WorkerId, tier: str) -> int:
        slot = self._slot_of.get(worker)
        return 0 if slot is None else self._lower_count.get((tier, slot), 0)

    def lower_run(self, worker: WorkerId, seq_hashes: Sequence[int], start: int) -> tuple[int, ...]:
        """How `worker`'s prefix goes on past block `start` (its device overlap) in the lower tiers: of the
        blocks from `start` that it holds in a row in any tier, how many sit in each of LOWER_TIERS (a block
        in two counts in the faster; one it holds on the device too counts in none)."""
        counts = [0] * len(LOWER_TIERS)
        slot = self._slot_of.get(worker)
        if slot is None or not self._lower:
            return tuple(counts)
        tiers = [self._lower.get(tier, {}) for tier in LOWER_TIERS]
        device = self._nodes
        for h in seq_hashes[start:]:
            for i, lower in enumerate(tiers):
                if lower.get(h, 0) >> slot & 1:
                    counts[i] += 1
                    break
            else:
                if not device.get(h, 0) >> slot & 1:
                    break
        return tuple(counts)

    # -- queries ---------------------------------------------------------------------------------
    def find_matches(self, seq_hashes: Sequence[int]) -> Overlaps:
        """For each worker holding the first block, how many leading blocks it holds in a row."""
        if type(seq_hashes) not in (list, tuple):
            seq_hashes = list(seq_hashes)
        return Overlaps(_match(self._nodes, seq_hashes), self._slot_of, self._worker_at)

    # -- state -----------------------------------------------------------------------------------
    def dump(self) -> IndexerSnapshot:
        return IndexerSnapshot(workers={w: self._held(s) for w, s in self._slot_of.items()})

    def restore(self, snapshot: IndexerSnapshot) -> None:
        """Replace the whole state with `snapshot`."""
        self.__init__(self.max_nodes)  # type: ignore[misc]
        for worker, hashes in snapshot.workers.items():
            self._slot(worker)
            self.store(worker, hashes)

    def memory(self) -> IndexerMemory:
        nodes = self._nodes
        size = sys.getsizeof(nodes) + sum(sys.getsizeof(h) + sys.getsizeof(m) for h, m in nodes.items())
        size += sum(sys.getsizeof(log) + sum(map(sys.getsizeof, log)) for log in self._log)
        size += sum(self._logged) * sys.getsizeof(1 << 63)  # the logs' hash ints
        return IndexerMemory(
            nodes=len(nodes),
            resident_blocks=sum(self._count),
            workers=len(self._slot_of),
            dropped_blocks=self.dropped_blocks,
            approx_bytes=size,
        )


class Overlaps(Mapping[WorkerId, int]):
    """find_matches' answer, {worker: matched blocks}, kept as (workers bitmask, depth) levels: with
    hundreds of workers sharing a system prompt, building the dict would cost more than the search,
    and a router usually asks about a few workers of one pool. A snapshot: later indexer changes do
    not alter it."""

    __slots__ = ("_levels", "_slot_of", "_worker_at")

    def __init__(self, levels: list[tuple[int, int]], slot_of: dict, worker_at: list) -> None:
        self._levels = levels
        # copies only when there is an answer: worker slots may be reused once the indexer moves on
        self._slot_of = slot_of.copy() if levels else slot_of
        self._worker_at = worker_at.copy() if levels else worker_at

    def __getitem__(self, worker: WorkerId) -> int:
        slot = self._slot_of.get(worker)
        if slot is not None:
            for mask, depth in self._levels:
                if mask >> slot & 1:
                    return depth
        raise KeyError(worker)

    def __iter__(self) -> Iterator[WorkerId]:
        for mask, _ in self._levels:
            yield from map(self._worker_at.__getitem__, _bits(mask))

    def __len__(self) -> int:
        return sum(mask.bit_count() for mask, _ in self._levels)

    def to_dict(self) -> dict[WorkerId, int]:
        """Every matched worker at once (what dict(self) gives, without a lookup per worker)."""
        out: dict[WorkerId, int] = {}
        for mask, depth in self._levels:
            out.update(dict.fromkeys(map(self._worker_at.__getitem__, _bits(mask)), depth))
        return out

    def items(self):  # Mapping's own items() and __eq__ would look each worker up again
        return self.to_dict().items()

    def __repr__(self) -> str:
        return f"Overlaps({self.to_dict()})"


def _bits(mask: int) -> list[int]:
    """Positions of the set bits of `mask`, lowest first."""
    if mask.bit_count() <= 8:
        out = []
        while mask:
            low = mask & -mask
            out.append(low.bit_length() - 1)
            mask ^= low
        return out
    raw = np.frombuffer(mask.to_bytes((mask.bit_length() + 7) // 8, "little"), dtype=np.uint8)
    return np.flatnonzero(np.unpackbits(raw, bitorder="little")).tolist()
