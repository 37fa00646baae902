"""Tolerant decoding of vLLM's event formats, hash translation, sequence checks and snapshots."""

import msgspec
import pytest

from router.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    decode_batch,
    encode_batch,
)
from router.hashing import block_hashes
from router.indexer import KvIndexer
from router.ingest import Delivery, EventIngestor, IngestSnapshot

TOKENS = list(range(500, 532))  # 2 blocks of 16
HASHES = block_hashes(TOKENS, 16)


def test_array_form_round_trips_and_ignores_extra_trailing_fields():
    events = [
        BlockStored([b"\x01" * 32], None, TOKENS[:16], 16, lora_name="x"),
        BlockRemoved([7]),
        AllBlocksCleared(),
    ]
    batch, unknown = decode_batch(encode_batch(events, dp_rank=1))
    assert batch.events == events and batch.data_parallel_rank == 1 and unknown == 0
    extra = msgspec.msgpack.encode(
        [
            1.5,
            [["BlockStored", [1], None, TOKENS[:16], 16, None, "GPU", None, [["k"]], 0, "full_attention"]],
            0,
            "x",
        ]
    )
    batch, _ = decode_batch(extra)
    assert batch.events == [BlockStored([1], None, TOKENS[:16], 16, None, "GPU")]


def test_map_forms_as_newer_vllm_sends_them():
    map_events = [
        {
            "type": "BlockStored",
            "block_hashes": [2**64 - 1],
            "parent_block_hash": b"\x02",
            "token_ids": TOKENS[:16],
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "group_idx": 0,
            "session_id": "s",
        },
        {"type": "BlockRemoved", "block_hashes": [b"\x03"], "medium": "GPU", "group_idx": 0},
        {"type": "AllBlocksCleared"},
    ]
    expected = [
        BlockStored([2**64 - 1], b"\x02", TOKENS[:16], 16, None, "GPU"),
        BlockRemoved([b"\x03"], "GPU"),
        AllBlocksCleared(),
    ]
    for raw in ([2.0, map_events, 0], {"ts": 2.0, "events": map_events, "data_parallel_rank": 0}):
        batch, unknown = decode_batch(msgspec.msgpack.encode(raw))
        assert unknown == 0 and batch.ts == 2.0
        assert [msgspec.structs.asdict(e) for e in batch.events] == [
            msgspec.structs.asdict(e) for e in expected
        ]
        assert all(
            isinstance(e, t) for e, t in zip(batch.events, [BlockStored, BlockRemoved, AllBlocksCleared])
        )


def test_unknown_event_kinds_are_skipped_and_counted():
    raw = msgspec.msgpack.encode(
        [1.0, [["BlockStored", [1], None, TOKENS[:16], 16], ["KVOffloaded", 3], {"type": "Other"}]]
    )
    batch, unknown = decode_batch(raw)
    assert len(batch.events) == 1 and unknown == 2


@pytest.mark.parametrize(
    "payload, message",
    [
        (b"\xc1", "not msgpack"),
        (msgspec.msgpack.encode(5), "not a KV event batch: 5"),
        (msgspec.msgpack.encode([1.0, [["BlockStored", "nope"]]]), "malformed BlockStored"),
    ],
)
def test_bad_payloads_name_the_problem(payload, message):
    with pytest.raises(EventDecodeError, match=message):
        decode_batch(payload)


def ingestor():
    return EventIngestor(KvIndexer(), 16)


def test_foreign_hashes_are_mapped_through_token_ids_and_removed_by_engine_hash():
    ing = ingestor()
    ing.apply_events("w", [BlockStored([b"a"], None, TOKENS[:16], 16)])
    ing.apply_events("w", [BlockStored([b"b"], b"a", TOKENS[16:], 16)])
    assert ing.indexer.find_matches(HASHES) == {"w": 2}
    ing.apply_events("w", [BlockRemoved([b"a"])])
    assert ing.indexer.find_matches(HASHES) == {}
    assert ing.indexer.holds("w", HASHES[1])  # the child stays, as in the engine


def test_project_hashes_need_no_map_entries():
    ing = ingestor()
    ing.apply_events(
        "w",
        [BlockStored(HASHES[:1], None, TOKENS[:16], 16), BlockStored(HASHES[1:], HASHES[0], TOKENS[16:], 16)],
    )
    assert ing.indexer.find_matches(HASHES) == {"w": 2}
    assert ing.dump().engine_to_project == {"w": []}
    ing.apply_events("w", [BlockRemoved(HASHES)])
    assert ing.indexer.memory().resident_blocks == 0


def test_lora_name_salts_the_chain():
    ing = ingestor()
    ing.apply_events("w", [BlockStored([1, 2], None, TOKENS, 16, lora_name="adapter")])
    assert ing.indexer.find_matches(block_hashes(TOKENS, 16, salt="adapter")) == {"w": 2}
    assert ing.indexer.find_matches(HASHES) == {}


def test_events_that_cannot_be_applied_exactly_are_skipped_and_counted():
    ing = ingestor()
    ing.apply_events(
        "w",
        [
            BlockStored([b"x"], b"never-stored", TOKENS[16:], 16),
            BlockStored([b"a"], None, TOKENS[:8], 8),
            BlockStored([b"a", b"b"], None, TOKENS[:16], 16),
        ],
    )
    assert (ing.stats.unknown_parent, ing.stats.rejected, ing.stats.blocks_stored) == (1, 2, 0)
    assert ing.indexer.memory().resident_blocks == 0


def test_sequence_order_gaps_duplicates_and_restarts():
    ing = ingestor()
    first = encode_batch([BlockStored([b"a"], None, TOKENS[:16], 16)])
    second = encode_batch([BlockStored([b"b"], b"a", TOKENS[16:], 16)])
    assert ing.expected_seq("w") is None
    assert ing.deliver("w", 5, first) is Delivery.APPLIED  # a late joiner takes what it gets
    assert ing.deliver("w", 5, first, live=False) is Delivery.DUPLICATE  # replay overlapping the live stream
    assert ing.deliver("w", 7, second) is Delivery.GAP
    assert ing.expected_seq("w") == 6 and ing.indexer.find_matches(HASHES) == {"w": 1}
    assert ing.deliver("w", 6, second) is Delivery.APPLIED
    assert ing.indexer.find_matches(HASHES) == {"w": 2}
    # the live stream going back: the engine restarted, its old cache is gone
    assert ing.deliver("w", 0, encode_batch([BlockRemoved([b"zz"])])) is Delivery.APPLIED
    assert ing.indexer.find_matches(HASHES) == {} and ing.stats.resets == 1
    assert (ing.stats.gaps, ing.stats.duplicates) == (1, 1)


def test_snapshot_round_trip_keeps_maps_and_sequence():
    ing = ingestor()
    ing.deliver("w", 0, encode_batch([BlockStored([b"a"], None, TOKENS[:16], 16)]))
    raw = msgspec.msgpack.encode(ing.dump())
    again = ingestor()
    again.restore(msgspec.msgpack.decode(raw, type=IngestSnapshot))
    assert again.expected_seq("w") == 1 and again.indexer.find_matches(HASHES) == {"w": 1}
    again.deliver("w", 1, encode_batch([BlockStored([b"b"], b"a", TOKENS[16:], 16)]))
    assert again.indexer.find_matches(HASHES) == {"w": 2}
