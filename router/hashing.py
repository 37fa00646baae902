"""The one block-hashing scheme of dynamo-pd, used by engines, indexer and router alike.

Tokens are encoded as little-endian u32. Each *full* block of `block_size` tokens gets a
local hash: xxh3_64(block bytes, seed=1337); a trailing partial block is never hashed.
Sequence hashes chain the local ones so a hash names a whole prefix:

    seq[0] = local[0]
    seq[i] = xxh3_64(le_u64(seq[i-1]) + le_u64(local[i]), seed=1337)

An optional salt (LoRA name, cache salt) starts the chain from a salted root instead:

    root    = xxh3_64(salt.encode("utf-8"), seed=1337)
    seq[0]  = xxh3_64(le_u64(root) + le_u64(local[0]), seed=1337)

so salted and unsalted prefixes never share blocks while local hashes stay salt-free.

A list or tuple of token ids is hashed by router/_index.c where the install built it (the prompt's hashes
are on every request's path; the same xxh3, from the xxhash package's own extension), anything else (numpy
arrays) and every build without it by the Python below; tests/router/test_hashing.py runs both.
"""

from __future__ import annotations

import array
import struct
import sys
from collections.abc import Sequence

import numpy as np
import xxhash

HASH_SEED = 1337
_PAIR = struct.Struct("<QQ")
_xxh3 = xxhash.xxh3_64_intdigest

try:
    from router._index import block_hashes as _c_block_hashes, local_hashes as _c_local_hashes
except ImportError:  # not built (router.indexer says so), or the xxhash extension exports no xxh3
    _c_block_hashes = _c_local_hashes = None


def token_bytes(token_ids: Sequence[int]) -> bytes:
    if isinstance(token_ids, np.ndarray):
        return np.asarray(token_ids, dtype="<u4").tobytes()
    try:
        packed = array.array("I", token_ids)  # 3x faster than numpy from a list
    except OverflowError:
        bad = next(t for t in token_ids if not 0 <= t < 2**32)
        raise ValueError(f"token id {bad} does not fit an unsigned 32-bit integer") from None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def local_hash(block_tokens: Sequence[int]) -> int:
    return _xxh3(token_bytes(block_tokens), HASH_SEED)


def chain_hash(parent: int | None, local: int) -> int:
    if parent is None:
        return local
    return _xxh3(_PAIR.pack(parent, local), HASH_SEED)


def salt_root(salt: str | None) -> int | None:
    return None if not salt else _xxh3(salt.encode("utf-8"), HASH_SEED)


def local_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Local hashes of every full block of `token_ids`."""
    if _c_local_hashes is not None and type(token_ids) in (list, tuple):
        return _c_local_hashes(token_ids, block_size)
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    data = memoryview(token_bytes(token_ids))
    step = 4 * block_size
    return [_xxh3(data[i:i + step], HASH_SEED) for i in range(0, len(data) - step + 1, step)]


def sequence_hashes(local_hashes: Sequence[int], parent: int | None = None) -> list[int]:
    """Chain local hashes into sequence hashes, continuing from `parent` (a seq hash or salt root)."""
    out: list[int] = []
    if not local_hashes:
        return out
    rest = local_hashes
    if parent is None:
        parent = local_hashes[0]
        out.append(parent)
        rest = local_hashes[1:]
    pack = _PAIR.pack  # chain_hash inlined: this loop runs for every block of every event and prompt
    for h in rest:
        parent = _xxh3(pack(parent, h), HASH_SEED)
        out.append(parent)
    return out


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[int]:
    """Sequence hashes of every full block of a prompt (the router's and indexer's key)."""
    return chained_block_hashes(token_ids, block_size, salt_root(salt))


def chained_block_hashes(token_ids: Sequence[int], block_size: int, parent: int | None) -> list[int]:
    """Sequence hashes of every full block of `token_ids`, continuing from `parent` (a seq hash or salt root):
    sequence_hashes(local_block_hashes(token_ids, block_size), parent) at once."""
    if _c_block_hashes is not None and type(token_ids) in (list, tuple):
        return _c_block_hashes(token_ids, block_size, parent)
    return sequence_hashes(local_block_hashes(token_ids, block_size), parent)
