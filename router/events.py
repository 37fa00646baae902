"""KV-cache events in vLLM's wire format (vllm.distributed.kv_events), defined here.

On the wire a batch is a ZMQ multipart message:
    [topic, 8-byte big-endian sequence number, msgpack(KVEventBatch)]
We encode both structs as msgpack arrays; events are tagged arrays: ["BlockStored", hashes, parent, ...]
(vLLM <= 0.10 and Dynamo's form). `decode_batch` also reads what newer vLLM sends (events as maps
tagged {"type": "BlockStored", ...}, a map-encoded batch), extra trailing fields or unknown keys, and
hashes as int or bytes. Unknown event kinds are skipped and counted, never guessed at.
Engines publish `block_hashes` in their own hash space; the indexer re-hashes `token_ids`
with router.hashing, so any engine's hash function works.
The tier a block is in is the events' `medium`, as vLLM and Dynamo name it: absent or "GPU" is the
engine's own pool (the device tier, even on a CPU host whose pool is host RAM), "CPU" the host tier and
"DISK" the disk tier below it. A lower tier's BlockStored names blocks by hash only (token_ids empty,
no parent): the block was stored in the device tier, under its tokens, before it moved down.
"""

from __future__ import annotations

import time
from typing import Any, Union

import msgspec

BlockHash = Union[int, bytes]

TIER_DEVICE, TIER_HOST, TIER_DISK = "GPU", "CPU", "DISK"
LOWER_TIERS = (TIER_HOST, TIER_DISK)  # fastest first
DEVICE_MEDIA = (None, TIER_DEVICE)  # the media that mean the device tier


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


# What the ingestor decodes: token_ids left as raw msgpack (decoded by `stored_tokens` only when re-hashed),
# and, for a worker trusted to publish the project's own hashes, those hashes typed as ints.
class LazyBlockStored(BlockStored, tag="BlockStored"):
    token_ids: msgspec.Raw  # type: ignore[assignment]


class ProjectBlockStored(LazyBlockStored, tag="BlockStored"):
    """From a trusted worker, with int hashes: indexed as they are, its tokens never read."""

    block_hashes: tuple[int, ...]  # type: ignore[assignment]  # a tuple: the indexer's log keeps it as it is
    parent_block_hash: int | None  # type: ignore[assignment]


class _LazyBatch(KVEventBatch):
    events: list[Union[LazyBlockStored, BlockRemoved, AllBlocksCleared]]


class _ProjectBatch(KVEventBatch):
    events: list[Union[ProjectBlockStored, BlockRemoved, AllBlocksCleared]]


_BatchDecoder = msgspec.msgpack.Decoder
_fast_decoders = [_BatchDecoder(KVEventBatch), _BatchDecoder(_BatchOfMaps)]
_ingest_decoders = [_BatchDecoder(_LazyBatch), _BatchDecoder(_BatchOfMaps)]
_trusted_decoders = [_BatchDecoder(_ProjectBatch), *_ingest_decoders]
_tokens_decoder = msgspec.msgpack.Decoder(list[int])
_EVENT_TAGS = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


class EventDecodeError(ValueError):
    """A payload that is not a KV event batch in any form we know."""


def decode_batch(payload: bytes) -> tuple[KVEventBatch, int]:
    """Decode one batch in any known form; returns (batch, number of unknown events skipped)."""
    return _decode(payload, _fast_decoders)


def decode_for_ingest(payload: bytes, trusted: bool) -> tuple[KVEventBatch, int]:
    """`decode_batch` for the ingestor: BlockStored token_ids stay raw (`stored_tokens` reads them), and
    with `trusted` a BlockStored with int hashes decodes as ProjectBlockStored."""
    return _decode(payload, _trusted_decoders if trusted else _ingest_decoders)


def stored_tokens(event: BlockStored) -> list[int]:
    """A BlockStored's token ids, decoded now if they were left raw."""
    tokens = event.token_ids
    if not isinstance(tokens, msgspec.Raw):
        return tokens
    try:
        return _tokens_decoder.decode(tokens)
    except msgspec.ValidationError as exc:
        raise EventDecodeError(f"malformed BlockStored token_ids: {exc}") from exc


def _decode(payload: bytes, decoders: list[msgspec.msgpack.Decoder]) -> tuple[KVEventBatch, int]:
    for decoder in decoders:
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
