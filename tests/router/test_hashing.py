"""The block hashing scheme: pinned vectors and an independent re-derivation with xxhash and struct."""

import struct

import pytest
import xxhash
from hypothesis import given, strategies as st

from router.hashing import (
    block_hashes,
    chain_hash,
    local_block_hashes,
    local_hash,
    salt_root,
    sequence_hashes,
)


def reference(tokens, block_size, salt=None):
    parent = None if not salt else xxhash.xxh3_64_intdigest(salt.encode(), seed=1337)
    out = []
    for i in range(len(tokens) // block_size):
        block = struct.pack(f"<{block_size}I", *tokens[i * block_size : (i + 1) * block_size])
        local = xxhash.xxh3_64_intdigest(block, seed=1337)
        parent = (
            local
            if parent is None
            else xxhash.xxh3_64_intdigest(struct.pack("<QQ", parent, local), seed=1337)
        )
        out.append(parent)
    return out


def test_pinned_vectors():
    assert local_block_hashes(list(range(8)), 4) == [9143094415614847814, 12124091508212882195]
    assert block_hashes(list(range(8)), 4) == [9143094415614847814, 9510318385840434533]
    assert salt_root("lora-a") == 8954828697784921239
    assert block_hashes(list(range(8)), 4, salt="lora-a") == [17032653568957413427, 14537915967081509407]
    assert block_hashes([0xFFFFFFFF, 1, 2, 3, 7], 4) == [18131274375548576900]  # partial block not hashed


def test_parts_compose():
    tokens = list(range(100, 148))
    locals_ = local_block_hashes(tokens, 16)
    assert locals_ == [local_hash(tokens[i : i + 16]) for i in range(0, 48, 16)]
    seqs = sequence_hashes(locals_)
    assert seqs[0] == locals_[0] and seqs[2] == chain_hash(seqs[1], locals_[2])
    # continuing a chain from a parent equals hashing the whole prefix
    assert sequence_hashes(locals_[2:], seqs[1]) == seqs[2:]
    assert salt_root(None) is None and salt_root("") is None


@given(
    st.lists(st.integers(0, 2**32 - 1), max_size=70),
    st.sampled_from([1, 4, 16]),
    st.one_of(st.none(), st.text(max_size=8)),
)
def test_matches_reference(tokens, block_size, salt):
    assert block_hashes(tokens, block_size, salt) == reference(tokens, block_size, salt)


def test_bad_block_size():
    with pytest.raises(ValueError, match="block_size must be positive, got 0"):
        block_hashes([1, 2], 0)


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_token_ids_outside_u32_are_named(bad):
    with pytest.raises(ValueError, match=f"token id {bad} does not fit"):
        block_hashes([1, bad, 2, 3], 4)


def test_numpy_input_hashes_like_a_list():
    import numpy as np

    tokens = list(range(40))
    assert block_hashes(np.array(tokens, dtype=np.int64), 8) == block_hashes(tokens, 8)
