"""The block hashing scheme: pinned vectors and an independent re-derivation with xxhash and struct, on both
builds of the hashing of token lists (router/_index.c and the Python path)."""

import importlib
import random
import struct
import subprocess
import sys

import pytest
import xxhash
from hypothesis import given, strategies as st

from router import hashing as hashing_module
from router.hashing import (
    block_hashes,
    chain_hash,
    chained_block_hashes,
    local_block_hashes,
    local_hash,
    salt_root,
    sequence_hashes,
)


@pytest.fixture(autouse=True, scope="module", params=["compiled", "python"])
def hashing_build(request):
    """Every test here runs on both builds: router/_index.c's hashing and the Python path."""
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "python":
            patch.setattr(hashing_module, "_c_block_hashes", None)
            patch.setattr(hashing_module, "_c_local_hashes", None)
        yield request.param


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


@given(st.lists(st.integers(0, 2**32 - 1), max_size=70), st.sampled_from([1, 3, 16, 64]),
       st.one_of(st.none(), st.integers(0, 2**64 - 1)))
def test_a_chain_continues_from_any_parent(tokens, block_size, parent):
    assert chained_block_hashes(tokens, block_size, parent) == \
        sequence_hashes(local_block_hashes(tokens, block_size), parent)
    assert chained_block_hashes(tuple(tokens), block_size, parent) == \
        reference_from(tokens, block_size, parent)


def xxh3_blocks(tokens, size):
    return [xxhash.xxh3_64_intdigest(struct.pack(f"<{size}I", *tokens[i:i + size]), seed=1337)
            for i in range(0, len(tokens) - size + 1, size)]


def reference_from(tokens, block_size, parent):
    out = []
    for local in xxh3_blocks(tokens, block_size):
        pair = None if parent is None else struct.pack("<QQ", parent, local)
        parent = local if pair is None else xxhash.xxh3_64_intdigest(pair, seed=1337)
        out.append(parent)
    return out


def test_the_install_built_the_compiled_hashing(hashing_build, monkeypatch):
    """setup.py builds router/_index.c, which finds xxh3 in the xxhash package's extension: the test venv must
    have both, or the compiled half of every test here would be the Python one."""
    compiled = importlib.import_module("router._index")
    assert callable(compiled.block_hashes) and callable(compiled.local_hashes)
    if hashing_build == "compiled":  # and a list of ids goes through it
        assert hashing_module._c_block_hashes is compiled.block_hashes
        calls = []
        for name in ("_c_block_hashes", "_c_local_hashes"):
            real = getattr(hashing_module, name)
            spy = lambda *args, real=real: calls.append(real) or real(*args)  # noqa: E731
            monkeypatch.setattr(hashing_module, name, spy)
        block_hashes(list(range(8)), 4, "salt")
        local_block_hashes((1, 2, 3, 4), 2)
        assert calls == [compiled.block_hashes, compiled.local_hashes]


def test_the_compiled_and_python_hashing_agree_on_long_prompts_of_any_ids():
    compiled = importlib.import_module("router._index")
    rng = random.Random(0)
    for _ in range(50):
        tokens = [rng.choice((rng.randrange(1 << 15), rng.randrange(1 << 30, 1 << 32)))
                  for _ in range(rng.randrange(5000))]
        size, parent = rng.choice((1, 16, 32, 100)), rng.choice((None, rng.getrandbits(64)))
        expected = sequence_hashes(xxh3_blocks(tokens, size), parent)
        assert compiled.block_hashes(tokens, size, parent) == expected
        assert compiled.local_hashes(tokens, size) == xxh3_blocks(tokens, size)
    with pytest.raises(TypeError, match="list or a tuple"):
        compiled.block_hashes(range(8), 4, None)
    with pytest.raises(TypeError):
        compiled.block_hashes([1, 2.0], 1, None)


def test_without_the_compiled_hashing_the_python_path_serves():
    code = ("import sys; sys.modules['router._index'] = None\n"  # as if the install had no compiler
            "from router import hashing\n"
            "assert hashing._c_block_hashes is None and hashing.block_hashes(list(range(8)), 4) == "
            "[9143094415614847814, 9510318385840434533]")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
