"""KV events that carry a tier (their `medium`), and the indexer that knows where each worker's blocks are."""

import msgspec

from router.events import (
    TIER_DISK,
    TIER_HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    encode_batch,
)
from router.hashing import block_hashes
from router.indexer import KvIndexer
from router.ingest import EventIngestor

BLOCK = 4
PROMPT = list(range(100, 100 + 10 * BLOCK))
CHAIN = block_hashes(PROMPT, BLOCK)


def stored(first: int, last: int, medium: str | None = None) -> BlockStored:
    """Device blocks carry their tokens and parent; a lower tier's carry hashes only."""
    if medium is not None:
        return BlockStored(block_hashes=CHAIN[first:last], parent_block_hash=None, token_ids=[],
                           block_size=BLOCK, medium=medium)
    return BlockStored(block_hashes=CHAIN[first:last], parent_block_hash=CHAIN[first - 1] if first else None,
                       token_ids=PROMPT[first * BLOCK:last * BLOCK], block_size=BLOCK)


def ingest(events, trusted: bool = True) -> EventIngestor:
    ingestor = EventIngestor(KvIndexer(), BLOCK)
    ingestor.trust("w", trusted)
    ingestor.deliver("w", 0, encode_batch(events))
    return ingestor


def test_a_tier_travels_in_the_medium_field_that_older_readers_already_decode():
    event = stored(0, 2, TIER_DISK)
    batch, skipped = decode_batch(encode_batch([event]))
    assert skipped == 0 and batch.events == [event]
    # vLLM's array form: the medium is its sixth field, where vLLM's own BlockStored puts it
    raw = msgspec.msgpack.decode(encode_batch([event]))
    assert raw[1][0][0] == "BlockStored" and raw[1][0][6] == TIER_DISK
    device = msgspec.msgpack.decode(encode_batch([stored(0, 2)]))
    assert device[1][0][6] is None, "a device event is encoded as before: no medium"


def test_lower_tiers_extend_a_prefix_past_the_device_overlap():
    # device holds blocks 0-3, the host tier 4-5, disk 6-7 and (a gap at 8) 9
    for trusted in (True, False):
        ingestor = ingest([stored(0, 4), stored(4, 6, TIER_HOST), stored(6, 8, TIER_DISK),
                           stored(9, 10, TIER_DISK)], trusted)
        indexer = ingestor.indexer
        assert indexer.find_matches(CHAIN).to_dict() == {"w": 4}, "lower tiers are not device overlap"
        assert indexer.lower_run("w", CHAIN, 4) == (2, 2)
        assert indexer.lower_run("w", CHAIN, 0) == (2, 2), "device blocks go on with the run, in no tier"
        assert indexer.lower_run("w", CHAIN, 9) == (0, 1)
        assert indexer.lower_run("other", CHAIN, 0) == (0, 0)
        assert (indexer.lower_blocks_of("w", TIER_HOST), indexer.lower_blocks_of("w", TIER_DISK)) == (2, 3)
        assert ingestor.stats.lower_stored == 5 and ingestor.stats.blocks_stored == 4


def test_a_block_in_two_tiers_counts_in_the_faster_and_removals_are_per_tier():
    ingestor = ingest([stored(0, 2, TIER_HOST), stored(0, 3, TIER_DISK)])
    indexer = ingestor.indexer
    assert indexer.lower_run("w", CHAIN, 0) == (2, 1)
    ingestor.apply_events("w", [BlockRemoved(block_hashes=CHAIN[0:2], medium=TIER_HOST)])
    assert indexer.lower_run("w", CHAIN, 0) == (0, 3)
    ingestor.apply_events("w", [BlockRemoved(block_hashes=CHAIN[1:2], medium=TIER_DISK)])
    assert indexer.lower_run("w", CHAIN, 0) == (0, 1), "the run stops at the removed block"
    # a device removal leaves the lower tiers alone
    ingestor.apply_events("w", [stored(0, 1), BlockRemoved(block_hashes=CHAIN[0:1])])
    assert indexer.lower_run("w", CHAIN, 0) == (0, 1)
    assert ingestor.stats.lower_removed == 3


def test_clears_resets_and_removed_workers_forget_their_lower_tiers():
    ingestor = ingest([stored(0, 2), stored(2, 4, TIER_DISK)])
    indexer = ingestor.indexer
    ingestor.apply_events("w", [AllBlocksCleared()])
    assert indexer.lower_run("w", CHAIN, 0) == (0, 0) and indexer.lower_blocks_of("w", TIER_DISK) == 0
    ingestor.apply_events("w", [stored(2, 4, TIER_DISK)])
    ingestor.remove_worker("w")
    indexer.store("v", CHAIN[:1])  # takes the freed slot: it must not inherit w's disk blocks
    assert indexer.lower_run("v", CHAIN, 1) == (0, 0)
    assert not any(indexer._lower.get(TIER_DISK, {}).values())


def test_a_medium_the_router_does_not_know_is_skipped_and_counted_never_taken_for_the_device():
    ingestor = ingest([stored(0, 2), stored(2, 4, "CPU_TIER3")])
    assert ingestor.indexer.lower_run("w", CHAIN, 2) == (0, 0)
    assert ingestor.indexer.find_matches(CHAIN).to_dict() == {"w": 2}
    assert ingestor.stats.unknown_events == 1
    # "GPU" is the device tier, as vLLM and SGLang send it
    gpu = msgspec.structs.replace(stored(2, 4), medium="GPU")
    ingestor.apply_events("w", [gpu])
    assert ingestor.indexer.find_matches(CHAIN).to_dict() == {"w": 4}


def test_lower_tiers_respect_the_node_bound():
    indexer = KvIndexer(max_nodes=2)
    indexer.store_lower("w", TIER_DISK, CHAIN[:5])
    assert indexer.lower_blocks_of("w", TIER_DISK) == 2 and indexer.dropped_blocks == 3
