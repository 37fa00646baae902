"""KV-cache events in vLLM's wire format (vllm.distributed.kv_events), defined here.

On the wire a batch is a ZMQ multipart message:
    [topic, 8-byte big-endian sequence number, msgpack(KVEventBatch)]
We encode both structs as msgpack arrays; events are tagged arrays: ["BlockStored", hashes, parent, ...]
(vLLM <= 0.10 and Dynamo's form). `decode_batch` also reads what newer vLLM sends (events as maps
tagged {"type": "BlockStored", ...}, a map-encoded batch), extra trailing fields or unknown keys, and
hashes as int or bytes. Unknown event kinds are skipped and counted, never guessed at.
Engines publish `block_hashes` in their own hash space; the indexer re-hashes `token_ids`
with router.hashing, so any engine's hash function works.
"""

from __future__ import annotations

import time
from typing import Any, Union

import msgspec

BlockHash = Union[int, bytes]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class of the three event kinds."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None  # vLLM >= 0.11: salts the project hashes (router.hashing.salt_root)


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()


def encode_batch(events: list[KVEvent], dp_rank: int | None = None) -> bytes:
    return _encoder.encode(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=dp_rank))


# Map-encoded twins ({"type": "BlockStored", "block_hashes": ...}); subclasses, so isinstance checks hold.
class _BlockStoredMap(BlockStored, array_like=False, tag="BlockStored"):
    pass


class _BlockRemovedMap(BlockRemoved, array_like=False, tag="BlockRemoved"):
    pass


class _AllBlocksClearedMap(AllBlocksCleared, array_like=False, tag="AllBlocksCleared"):
    pass


_MapEvent = Union[_BlockStoredMap, _BlockRemovedMap, _AllBlocksClearedMap]


class _BatchOfMaps(KVEventBatch):
    events: list[_MapEvent]


class _MapBatch(msgspec.Struct):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


_fast_decoders = [msgspec.msgpack.Decoder(KVEventBatch), msgspec.msgpack.Decoder(_BatchOfMaps)]
_EVENT_TAGS = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


class EventDecodeError(ValueError):
    """A payload that is not a KV event batch in any form we know."""


def decode_batch(payload: bytes) -> tuple[KVEventBatch, int]:
    """Decode one batch in any known form; returns (batch, number of unknown events skipped)."""
    for decoder in _fast_decoders:
        try:
            return decoder.decode(payload), 0
        except msgspec.ValidationError:
            continue
        except msgspec.DecodeError as exc:
            raise EventDecodeError(f"KV event payload is not msgpack ({len(payload)} bytes): {exc}") from exc
    return _decode_slow(payload)


def _decode_slow(payload: bytes) -> tuple[KVEventBatch, int]:
    """Per-event decoding: mixed forms, a map-encoded batch, unknown event kinds."""
    raw = msgspec.msgpack.decode(payload)
    try:
        batch = msgspec.convert(raw, _MapBatch) if isinstance(raw, dict) else \
            _MapBatch(*raw[:3]) if isinstance(raw, list) and len(raw) >= 2 else None
    except (msgspec.ValidationError, TypeError) as exc:
        raise EventDecodeError(f"not a KV event batch: {str(raw)[:200]}") from exc
    if batch is None or not isinstance(batch.events, list):
        raise EventDecodeError(f"not a KV event batch: {str(raw)[:200]}")
    events: list[KVEvent] = []
    skipped = 0
    for raw_event in batch.events:
        tag = raw_event[0] if isinstance(raw_event, list) and raw_event else \
            raw_event.get("type") if isinstance(raw_event, dict) else None
        if tag not in _EVENT_TAGS:
            skipped += 1
            continue
        target = KVEvent if isinstance(raw_event, list) else _MapEvent
        try:
            events.append(msgspec.convert(raw_event, target))
        except msgspec.ValidationError as exc:
            raise EventDecodeError(f"malformed {tag} event {str(raw_event)[:200]}: {exc}") from exc
    rank = batch.data_parallel_rank
    return KVEventBatch(ts=float(batch.ts), events=events, data_parallel_rank=rank), skipped
