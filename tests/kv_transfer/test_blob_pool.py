"""BlobPool: byte strings (llama.cpp sequence states) in blocks that the KV transfer agent moves like KV."""

import random

import pytest

from kv_transfer import KVMemory, KVTransferAgent, TransferConfig
from kv_transfer.memory import BlobPool


def test_blobs_round_trip_through_scattered_blocks():
    pool = BlobPool(num_blocks=16, block_bytes=64)
    for size in (0, 1, 55, 56, 57, 300):
        data = random.Random(size).randbytes(size)
        ids = pool.allocate(pool.blocks_for(size))
        assert len(ids) == -(-(size + 8) // 64)
        scattered = ids[::-1]
        pool.write(scattered, data)
        assert pool.read(scattered) == data
        pool.free(ids)
    spare = pool.allocate(4)  # more blocks than the blob needs
    pool.write(spare, b"short")
    assert pool.read(spare) == b"short"
    pool.free(spare)
    assert pool.num_free == 16


def test_pool_refuses_what_it_cannot_hold():
    pool = BlobPool(num_blocks=2, block_bytes=64)
    with pytest.raises(MemoryError, match="3 blocks wanted, 2 of 2 free"):
        pool.allocate(3)
    with pytest.raises(ValueError, match="need 2 blocks, got 1"):
        pool.write(pool.allocate(1), bytes(100))
    with pytest.raises(ValueError, match="even number of bytes"):
        BlobPool(4, 63)


@pytest.mark.parametrize("transport", ["zmq", "inproc"])
async def test_agent_pulls_and_pushes_blobs(transport):
    """The agent's hold / pull / push move a blob between two pools unchanged (one block per token
    here, as the llama.cpp engine counts them)."""
    prefill, decode = BlobPool(32, 128), BlobPool(32, 128)
    blob = random.Random(7).randbytes(1000)
    held = prefill.allocate(prefill.blocks_for(len(blob)))
    prefill.write(held, blob)
    released = []
    async with KVTransferAgent("p", KVMemory.native(prefill.tensor, "m"), TransferConfig(transport)) as p, \
            KVTransferAgent("d", KVMemory.native(decode.tensor, "m"), TransferConfig(transport)) as d:
        local = decode.allocate(len(held))
        desc = p.hold("r1", held, len(held), lambda rid, why, _: released.append((rid, why.value)))
        assert await d.pull(desc, local) == len(held) * 128
        assert decode.read(local) == blob and released == [("r1", "done")]
        target = d.hold("r2", decode.allocate(len(held)), len(held), lambda *_: None, writable=True)
        await p.push(target, held)
        assert decode.read(target.block_ids) == blob
