"""KV events for engines that say which token sequences they hold, not which blocks (llama.cpp,
mistral.rs): each held sequence is hashed with the project's scheme (router.hashing), blocks are
counted across sequences, and only changes become events, so the router's indexer sees what the
engine holds in the same hashes as every other worker.

    events = TokenEvents(block_size=16)
    events.hold("slot-0", prompt + output)   # the engine's slot 0 now holds these tokens (replaces)
    events.drop("slot-0")                    # ... and now nothing
    batch = events.drain()                   # BlockStored / BlockRemoved since the last drain
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence

from router.events import BlockRemoved, BlockStored, KVEvent
from router.hashing import block_hashes


class TokenEvents:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self._held: dict[str, list[int]] = {}  # key -> sequence hashes of its full blocks
        self._count: Counter[int] = Counter()  # sequence hash -> keys holding it
        self._events: list[KVEvent] = []
        self._lock = threading.Lock()  # engines call from their step thread, the worker drains on its loop

    def hold(self, key: str, token_ids: Sequence[int], salt: str | None = None) -> None:
        """`key` (an engine's slot or cache entry) now holds `token_ids`, instead of what it held."""
        size = self.block_size
        full = len(token_ids) - len(token_ids) % size
        hashes = block_hashes(token_ids[:full], size, salt)
        with self._lock:
            # Stored first, then the old ones removed: blocks both share never leave the indexer.
            new = [i for i, h in enumerate(hashes) if self._count[h] == 0]
            for h in hashes:
                self._count[h] += 1
            if new:  # a chained hash names its whole prefix, so blocks not yet held are a suffix
                first = new[0]
                self._events.append(BlockStored(
                    block_hashes=hashes[first:], parent_block_hash=hashes[first - 1] if first else None,
                    token_ids=list(token_ids[first * size:full]), block_size=size, lora_name=salt or None))
            self._release(self._held.pop(key, []))
            self._held[key] = hashes

    def drop(self, key: str) -> None:
        with self._lock:
            self._release(self._held.pop(key, []))

    def _release(self, hashes: list[int]) -> None:
        gone = []
        for h in hashes:
            self._count[h] -= 1
            if self._count[h] == 0:
                del self._count[h]
                gone.append(h)
        if gone:
            self._events.append(BlockRemoved(block_hashes=gone[::-1]))  # children before parents

    def drain(self) -> list[KVEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events
