"""KV tiers below the engine's pool: a host tier (RAM) and a disk tier (files), least recently used first.

A cached block the pool evicts (BlockManager._allocate reuses its memory) is copied down first: into the
host tier when there is one (`--kv-host-gb`, pinned when the pool is on a GPU: on a CPU host the pool already
is host RAM, so there the disk is the tier below it), else to disk; a block the host tier evicts goes on to
disk. The frequency filter: a block goes to disk only once it has been used twice, that is a prefix hit
reused it while it was cached, or it was evicted once before (remembered by hash) and computed again; so
a one-off prompt never churns the disk. Tiers are inclusive: a block copied back up keeps its lower copies.

A hit in a lower tier is copied back into a pool block before the prefill (BlockManager.admit), instead of
being recomputed. Disk blocks are files named by hash in a directory of the engine's own under
`--kv-disk-dir`, written by a writer thread (until then the block is served from memory), bounded by
`--kv-disk-gb` (the least recently used file goes), and the directory is removed when the engine stops.
A file is a header (magic, hash, length, xxh3-64 checksum of the bytes) and the block's bytes: one whose
header, length or checksum is wrong is dropped and its block recomputed, never served.
Every store and removal is a KV event whose medium is the tier (router.events); the calls return them,
and the block manager records them in order with its own.
"""

from __future__ import annotations

import logging
import queue
import shutil
import struct
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash

from router.events import LOWER_TIERS, TIER_DISK, TIER_HOST, BlockRemoved, BlockStored, KVEvent

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<4sQQQ")  # magic, block hash, payload length, xxh3-64 of the payload
_MAGIC = b"DPKV"


@dataclass(frozen=True)
class TierConfig:
    host_blocks: int = 0
    disk_blocks: int = 0
    disk_dir: str = ""  # "": the system's temporary directory

    @classmethod
    def of(cls, host_gb: float, disk_gb: float, disk_dir: str | None, block_bytes: int) -> TierConfig:
        """Sized in GiB of `block_bytes` blocks (the profiled model's, in the mocker)."""
        return cls(int(host_gb * 2**30) // block_bytes, int(disk_gb * 2**30) // (block_bytes + _HEADER.size),
                   disk_dir or "")

    @property
    def enabled(self) -> bool:
        return self.host_blocks > 0 or self.disk_blocks > 0


@dataclass
class TierUse:
    """One lower tier's state and what it served, for a worker's metrics."""

    tier: str
    blocks: int = 0
    capacity: int = 0
    hits: int = 0  # blocks copied back up from it
    onboarded_bytes: int = 0  # the engine core counts these two: the mocker's are its profiled model's
    onboarded_seconds: float = 0.0
    corrupt: int = 0  # disk blocks dropped as unreadable (checksum, length or header)


@dataclass
class Onboarded:
    """One copy-back of a run of blocks from one tier, for the fetch cost meter."""

    tier: str
    blocks: int
    seconds: float


@dataclass
class _Disk:
    path: Path
    capacity: int
    lru: OrderedDict[int, None] = field(default_factory=OrderedDict)  # hash -> present (a file, or pending)
    pending: dict[int, bytes] = field(default_factory=dict)  # written by the writer thread, not yet on disk
    # guards pending and lru; notified as blocks are written or dropped
    lock: threading.Condition = field(default_factory=threading.Condition)
    writes: queue.Queue = field(default_factory=queue.Queue)
    writer: threading.Thread | None = None

    def file(self, h: int) -> Path:
        return self.path / f"{h:016x}.kv"


class KVTiers:
    def __init__(self, kv_cache: torch.Tensor, config: TierConfig, block_size: int):
        """`kv_cache` is the engine's pool, indexed [layers, 2, blocks, block_size, heads, head_dim]."""
        self.kv_cache = kv_cache
        self.config = config
        self.block_size = block_size
        self._shape = tuple(kv_cache[:, :, 0].shape)
        self.block_bytes = kv_cache[:, :, 0].numel() * kv_cache.element_size()
        pinned = kv_cache.device.type == "cuda"  # pinned memory copies to and from the GPU asynchronously
        self._host = torch.empty((config.host_blocks, *self._shape), dtype=kv_cache.dtype, pin_memory=pinned)
        self._host_slot: OrderedDict[int, int] = OrderedDict()  # hash -> slot, least recently used first
        self._host_hit: dict[int, bool] = {}  # hash -> used twice (the frequency filter, on its way to disk)
        self._free_slots = list(range(config.host_blocks - 1, -1, -1))
        self._seen: OrderedDict[int, None] = OrderedDict()  # evicted once, not written: next time it is
        self.use = {tier: TierUse(tier) for tier in LOWER_TIERS}
        self.use[TIER_HOST].capacity = config.host_blocks
        self.use[TIER_DISK].capacity = config.disk_blocks
        self.onboarded: list[Onboarded] = []  # since the engine last took them (take_onboarded)
        self._disk: _Disk | None = None
        if config.disk_blocks:
            root = Path(config.disk_dir or tempfile.gettempdir())
            root.mkdir(parents=True, exist_ok=True)
            path = Path(tempfile.mkdtemp(prefix="dynamo_pd-kv-", dir=root))
            self._disk = disk = _Disk(path, config.disk_blocks)
            disk.writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
            disk.writer.start()

    @property
    def disk_path(self) -> Path | None:
        return self._disk.path if self._disk else None

    def _view(self, block_id: int) -> torch.Tensor:
        return self.kv_cache[:, :, block_id]

    # ---- down: the pool evicts

    def offload(self, h: int, block_id: int, hit: bool) -> list[KVEvent]:
        """The pool is about to reuse `block_id`, cached under `h`: keep a copy below. `hit`: a prefix hit
        reused it while it was cached."""
        if self.config.host_blocks:
            return self._to_host(h, block_id, hit)
        return self._to_disk(h, lambda: self._view(block_id), hit)

    def _to_host(self, h: int, block_id: int, hit: bool) -> list[KVEvent]:
        if h in self._host_slot:  # inclusive: the copy below is this block's already
            self._host_slot.move_to_end(h)
            self._host_hit[h] = self._host_hit[h] or hit
            return []
        events: list[KVEvent] = []
        if not self._free_slots:
            old, slot = self._host_slot.popitem(last=False)
            events.append(BlockRemoved(block_hashes=[old], medium=TIER_HOST))
            events += self._to_disk(old, lambda: self._host[slot], self._host_hit.pop(old))
            self._free_slots.append(slot)
        slot = self._free_slots.pop()
        self._host[slot].copy_(self._view(block_id))
        self._host_slot[h], self._host_hit[h] = slot, hit
        events.append(_stored(h, TIER_HOST, self.block_size))
        return events

    def _to_disk(self, h: int, data, hit: bool) -> list[KVEvent]:
        disk = self._disk
        if disk is None:
            return []
        if h in disk.lru:
            disk.lru.move_to_end(h)
            return []
        if not hit and h not in self._seen:  # the frequency filter: remember it, write it the second time
            self._seen[h] = None
            while len(self._seen) > disk.capacity:
                self._seen.popitem(last=False)
            return []
        self._seen.pop(h, None)
        payload = data().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes()
        events: list[KVEvent] = []
        with disk.lock:
            while len(disk.lru) >= disk.capacity:
                events.append(self._drop_disk(next(iter(disk.lru))))
            disk.lru[h] = None
            disk.pending[h] = payload
        disk.writes.put(h)
        events.append(_stored(h, TIER_DISK, self.block_size))
        return events

    def _drop_disk(self, h: int) -> BlockRemoved:
        """Forget a disk block (evicted, or found unreadable); the caller holds the disk lock."""
        disk = self._disk
        del disk.lru[h]
        if disk.pending.pop(h, None) is None:  # written: its file goes (else the writer sees it gone)
            disk.file(h).unlink(missing_ok=True)
        disk.lock.notify_all()
        return BlockRemoved(block_hashes=[h], medium=TIER_DISK)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every disk block is in its file; False when that took longer than `timeout_s`."""
        disk = self._disk
        if disk is None:
            return True
        with disk.lock:
            return disk.lock.wait_for(lambda: not disk.pending, timeout_s)

    def _write_loop(self) -> None:
        disk = self._disk
        while (h := disk.writes.get()) is not None:
            with disk.lock:
                payload = disk.pending.get(h)
            if payload is None:
                continue  # dropped before it was written
            path = disk.file(h)
            try:
                tmp = path.with_suffix(".tmp")
                with open(tmp, "wb") as f:
                    f.write(_HEADER.pack(_MAGIC, h, len(payload), xxhash.xxh3_64_intdigest(payload)))
                    f.write(payload)
                tmp.replace(path)  # a reader never sees a half-written file under the block's name
            except OSError as exc:  # a full or failing disk: the block stays served from memory until evicted
                log.warning("KV disk tier: writing %s failed: %s", path, exc)
                continue
            with disk.lock:
                if h not in disk.lru:
                    path.unlink(missing_ok=True)  # evicted while it was written
                elif disk.pending.get(h) is payload:
                    del disk.pending[h]
                    disk.lock.notify_all()

    # ---- up: a prefix hit below the pool

    def find(self, h: int) -> str | None:
        """The fastest tier holding `h`, refreshed as recently used; None: none does."""
        if h in self._host_slot:
            self._host_slot.move_to_end(h)
            return TIER_HOST
        if self._disk is not None and h in self._disk.lru:
            self._disk.lru.move_to_end(h)
            return TIER_DISK
        return None

    def onboard(self, blocks: list[tuple[int, int]]) -> tuple[int, list[KVEvent]]:
        """Copy (hash, pool block) pairs back into the pool, in order, until one cannot be (gone, or an
        unreadable file: dropped); returns how many were and the events."""
        events: list[KVEvent] = []
        done = 0
        runs: dict[str, Onboarded] = {}
        for h, block_id in blocks:
            started = time.perf_counter()
            tier = self.find(h)
            if tier == TIER_HOST:
                self._view(block_id).copy_(self._host[self._host_slot[h]])
            elif tier != TIER_DISK or not self._read_disk(h, block_id, events):
                break
            seconds = time.perf_counter() - started
            self.use[tier].hits += 1
            run = runs.setdefault(tier, Onboarded(tier, 0, 0.0))
            run.blocks += 1
            run.seconds += seconds
            done += 1
        self.onboarded += runs.values()
        return done, events

    def _read_disk(self, h: int, block_id: int, events: list[KVEvent]) -> bool:
        disk = self._disk
        with disk.lock:
            payload = disk.pending.get(h)
        if payload is None:
            payload = self._checked(h, disk.file(h))
        if payload is None:
            self.use[TIER_DISK].corrupt += 1
            with disk.lock:
                events.append(self._drop_disk(h))
            return False
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.kv_cache.dtype)
        self._view(block_id).copy_(data.view(self._shape))
        return True

    def _checked(self, h: int, path: Path) -> bytes | None:
        """The file's payload if its header, length and checksum hold; None (and a warning) otherwise."""
        try:
            raw = path.read_bytes()
        except OSError as exc:
            log.warning("KV disk tier: %s unreadable (%s): recomputed", path, exc)
            return None
        head, payload = raw[:_HEADER.size], raw[_HEADER.size:]
        if len(head) == _HEADER.size:
            magic, stored, length, checksum = _HEADER.unpack(head)
            if (magic, stored, length) == (_MAGIC, h, self.block_bytes) and len(payload) == length \
                    and xxhash.xxh3_64_intdigest(payload) == checksum:
                return payload
        log.warning("KV disk tier: %s fails its header, length or checksum: dropped and recomputed", path)
        return None

    def take_onboarded(self) -> list[Onboarded]:
        taken, self.onboarded = self.onboarded, []
        return taken

    # ---- state

    def usage(self) -> tuple[TierUse, ...]:
        """A snapshot of each tier's use (the engine's stats)."""
        self.use[TIER_HOST].blocks = len(self._host_slot)
        self.use[TIER_DISK].blocks = len(self._disk.lru) if self._disk else 0
        return tuple(TierUse(**vars(u)) for u in self.use.values() if u.capacity)

    def clear(self) -> None:
        """Forget every block (the pool's AllBlocksCleared covers the tiers' events too)."""
        self._free_slots = list(range(self.config.host_blocks - 1, -1, -1))
        self._host_slot.clear()
        self._host_hit.clear()
        self._seen.clear()
        if self._disk is not None:
            with self._disk.lock:
                for h in list(self._disk.lru):
                    self._drop_disk(h)

    def close(self) -> None:
        """The engine stops: the writer ends and the disk tier's directory goes."""
        disk = self._disk
        if disk is None or disk.writer is None:
            return
        with disk.lock:
            disk.pending.clear()  # nothing left to write: the files go anyway
        disk.writes.put(None)
        disk.writer.join(timeout=30.0)
        disk.writer = None
        shutil.rmtree(disk.path, ignore_errors=True)


def _stored(h: int, tier: str, block_size: int) -> BlockStored:
    return BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[], block_size=block_size,
                       medium=tier)
