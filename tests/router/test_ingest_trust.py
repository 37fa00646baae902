"""A worker trusted to publish the project's hashes: indexed as sent, tokens never read; others re-hashed."""

import msgspec
import pytest

from router.events import BlockRemoved, BlockStored, EventDecodeError, encode_batch
from router.hashing import block_hashes
from router.indexer import KvIndexer
from router.ingest import EventIngestor

TOKENS = list(range(500, 532))  # 2 blocks of 16
HASHES = block_hashes(TOKENS, 16)


def trusted_ingestor() -> EventIngestor:
    ing = EventIngestor(KvIndexer(), 16)
    ing.trust("w")
    return ing


def test_a_trusted_workers_hashes_are_indexed_without_reading_its_tokens():
    ing = trusted_ingestor()
    # tokens that would re-hash to something else (and even malformed ones) are not read
    bogus = msgspec.msgpack.encode([1.0, [["BlockStored", HASHES[:1], None, ["not", "tokens"], 16]]])
    ing.deliver("w", 0, bogus)
    ing.deliver("w", 1, encode_batch([BlockStored(HASHES[1:], HASHES[0], [0] * 16, 16)]))
    assert ing.indexer.find_matches(HASHES) == {"w": 2}
    assert ing.dump().engine_to_project == {"w": []}
    ing.deliver("w", 2, encode_batch([BlockRemoved(HASHES[:1])]))
    assert ing.indexer.find_matches(HASHES) == {} and ing.indexer.holds("w", HASHES[1])


def test_a_trusted_workers_events_still_need_a_known_parent_and_the_block_size():
    ing = trusted_ingestor()
    ing.deliver("w", 0, encode_batch([BlockStored([5], 4, TOKENS[:16], 16), BlockStored([6], None, TOKENS, 8)]))
    assert (ing.stats.unknown_parent, ing.stats.rejected, ing.stats.blocks_stored) == (1, 1, 0)


def test_a_trusted_worker_sending_foreign_hashes_is_re_hashed():
    ing = trusted_ingestor()
    ing.deliver("w", 0, encode_batch([BlockStored([b"a", b"b"], None, TOKENS, 16)]))
    assert ing.indexer.find_matches(HASHES) == {"w": 2}


def test_an_untrusted_worker_is_re_hashed_from_its_tokens():
    ing = EventIngestor(KvIndexer(), 16)
    ing.deliver("w", 0, encode_batch([BlockStored([1, 2], None, TOKENS, 16)]))
    assert ing.indexer.find_matches(HASHES) == {"w": 2} and ing.indexer.find_matches([1, 2]) == {}
    bogus = msgspec.msgpack.encode([1.0, [["BlockStored", [3], None, ["not", "tokens"], 16]]])
    with pytest.raises(EventDecodeError, match="malformed BlockStored token_ids"):
        ing.deliver("w", 1, bogus)
    assert ing.expected_seq("w") == 1  # the batch was not applied


def test_trust_is_forgotten_with_the_worker():
    ing = trusted_ingestor()
    ing.remove_worker("w")
    ing.deliver("w", 0, encode_batch([BlockStored([1, 2], None, TOKENS, 16)]))
    assert ing.indexer.find_matches(HASHES) == {"w": 2}
