"""TokenEvents: what an engine says it holds, as KV events the router's indexer reads in project hashes."""

from dynamo_pd.engines.token_events import TokenEvents
from router.events import BlockRemoved, BlockStored, decode_batch, encode_batch
from router.hashing import block_hashes
from router.indexer import KvIndexer
from router.ingest import EventIngestor

BS = 4


def indexed(events: TokenEvents, ingestor: EventIngestor) -> None:
    batch, _ = decode_batch(encode_batch(events.drain()))  # through the wire format, as the worker sends it
    ingestor.apply_events("w", batch.events)


def test_holding_replacing_and_dropping_sequences():
    events = TokenEvents(BS)
    a = list(range(10))  # 2 full blocks and 2 tokens
    events.hold("slot", a)
    assert events.drain() == [BlockStored(block_hashes=block_hashes(a, BS), parent_block_hash=None,
                                          token_ids=a[:8], block_size=BS)]
    events.hold("slot", a)
    assert events.drain() == []  # nothing changed
    b = a[:4] + [99] * 9  # shares the first block with a
    events.hold("slot", b)
    hb = block_hashes(b, BS)
    assert events.drain() == [
        BlockStored(block_hashes=hb[1:], parent_block_hash=hb[0], token_ids=b[4:12], block_size=BS),
        BlockRemoved(block_hashes=[block_hashes(a, BS)[1]]),
    ]
    events.drop("slot")
    assert events.drain() == [BlockRemoved(block_hashes=hb[::-1])]


def test_blocks_shared_by_two_slots_stay_until_both_drop_them():
    events, ingestor = TokenEvents(BS), EventIngestor(KvIndexer(), BS)
    a, b = list(range(12)), list(range(8)) + [50, 51, 52, 53]
    events.hold("x", a)
    events.hold("y", b)
    indexed(events, ingestor)
    assert ingestor.indexer.find_matches(block_hashes(a, BS))["w"] == 3
    assert ingestor.indexer.find_matches(block_hashes(b, BS))["w"] == 3
    events.drop("x")
    indexed(events, ingestor)
    assert ingestor.indexer.find_matches(block_hashes(a, BS))["w"] == 2  # the shared prefix stays
    events.drop("y")
    indexed(events, ingestor)
    assert ingestor.indexer.blocks_of("w") == 0
    assert ingestor.stats.unknown_parent == 0


def test_salted_sequences_hash_apart_and_index_under_their_salt():
    events, ingestor = TokenEvents(BS), EventIngestor(KvIndexer(), BS)
    tokens = list(range(8))
    events.hold("x", tokens, salt="tenant-a")
    events.hold("y", tokens)
    indexed(events, ingestor)
    assert ingestor.indexer.find_matches(block_hashes(tokens, BS, "tenant-a"))["w"] == 2
    assert ingestor.indexer.find_matches(block_hashes(tokens, BS))["w"] == 2
    assert ingestor.indexer.blocks_of("w") == 4
