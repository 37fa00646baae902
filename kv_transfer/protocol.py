"""What crosses process boundaries in a KV hand-off: the transfer descriptor, the side-channel
messages, and the typed errors both sides raise.

Hand-off (pull, the default; vLLM / Dynamo / TensorRT-LLM style):
    prefill: desc = agent.hold(rid, blocks, on_release)  -> desc travels with the first token
    decode:  await agent.pull(desc, my_blocks, skip_prefix_blocks=n)
             = Begin (peer pins the hold) -> bytes move -> Finish (peer releases: on_release(DONE))
Push (SGLang style): decode holds writable blocks and sends their descriptor to the prefill side
    (Reserve, keyed by the request id both sides share: the "room"); prefill waits for it, calls
    await agent.push(desc, its_blocks, payload=...); decode's on_release fires with DONE and the
    payload (the first token) once the blocks are filled.
Peer pull (a prefix one worker holds, read by another instead of recomputed):
    puller:  await agent.pull_prefix(holder_endpoint, rid, block_hashes, my_blocks, skip_blocks=n)
             = HoldPrefix (the holder pins the longest prefix of the hashes it has, or refuses: busy)
             -> the pull above over the descriptor it returns -> Finish (the holder unpins them)
"""

from __future__ import annotations

import enum

import msgspec

from kv_transfer.layout import KVLayout


class TransferDescriptor(msgspec.Struct, frozen=True):
    """Where a held set of blocks lives and how to reach it. Produced by KVTransferAgent.hold."""

    engine_id: str
    request_id: str
    transport: str  # "nixl" | "zmq" | "inproc"
    endpoint: str  # the side channel of the holding agent
    agent_name: str  # NIXL agent name; "" for other transports
    layout: KVLayout
    compat_hash: int
    base_addrs: list[int]  # buffer base addresses: with layout, they give every block's regions
    mem_type: str  # "DRAM" | "VRAM"
    device_id: int  # GPU index for VRAM, 0 for DRAM
    block_ids: list[int]  # the request's blocks [block_offset, block_offset + len) in order
    num_tokens: int  # tokens of the request the blocks hold (the last block may be partial)
    block_offset: int = 0  # index of block_ids[0] in the request's block sequence
    writable: bool = False  # True: a push target (decode reserved these blocks for the peer to fill)
    lease_deadline: float = 0.0  # unix time after which the holder frees the blocks


class ReleaseReason(enum.Enum):
    DONE = "done"  # the peer finished reading (pull) or writing (push)
    EXPIRED = "expired"  # the lease ran out before the peer finished
    ERROR = "error"  # the peer reported a failure
    CANCELLED = "cancelled"  # released locally (request aborted) or the agent closed


class TransferError(Exception):
    """Base of every kv_transfer failure. The caller still owns and must free its own blocks."""


class CompatError(TransferError):
    """The two caches cannot exchange blocks (model, dtype, layers, heads or head size differ)."""


class LeaseExpiredError(TransferError):
    """The holder's lease ran out; it has freed the blocks."""


class BlocksFreedError(TransferError):
    """The holder no longer has these blocks (already transferred, released or never held)."""


class PeerLostError(TransferError):
    """The peer did not answer in time or its transport failed (process died, network down)."""


class PeerBusyError(TransferError):
    """The holder refused to pin a prefix for a peer now (it serves others, or its pool is short)."""


class Begin(msgspec.Struct, tag=True):
    """Initiator -> holder: pin the hold for the duration of a transfer."""

    request_id: str
    compat_hash: int
    timeout_s: float  # how long the initiator may take; the holder keeps the blocks that long


class Finish(msgspec.Struct, tag=True):
    """Initiator -> holder: the transfer ended; release the hold (DONE if ok, else ERROR)."""

    request_id: str
    ok: bool
    message: str = ""
    payload: bytes = b""  # opaque to kv_transfer; handed to the holder's on_release (push: first token)
    nbytes: int = 0  # what the initiator moved: the holder counts it (it cannot see one-sided NIXL reads)


class Reserve(msgspec.Struct, tag=True):
    """Push mode, decode -> prefill: the blocks `target` describes wait for the prefill to fill them."""

    request_id: str
    target: TransferDescriptor


class Fetch(msgspec.Struct, tag=True):
    """ZMQ pull: stream these held blocks (a subset of the hold) back."""

    request_id: str
    block_ids: list[int]


class Write(msgspec.Struct, tag=True):
    """ZMQ push: the frames that follow fill these held blocks."""

    request_id: str
    block_ids: list[int]


class Pack(msgspec.Struct, tag=True):
    """NIXL pull of scattered blocks: pack these held blocks into one registered buffer; the reply's
    payload is its address (8 bytes, little-endian) then the NIXL partial metadata that lets the
    reader reach it. Valid until the hold ends."""

    request_id: str
    block_ids: list[int]


class HoldPrefix(msgspec.Struct, tag=True):
    """Puller -> holder: pin the cached blocks holding the longest prefix of `block_hashes` (router.hashing's
    sequence hashes) and hold them under `request_id`; the reply's payload is their TransferDescriptor."""

    request_id: str
    block_hashes: list[int]


class GetMetadata(msgspec.Struct, tag=True):
    """Ask for the holder's NIXL agent metadata."""


class Reply(msgspec.Struct):
    ok: bool
    error: str = ""  # "" | "expired" | "freed" | "compat" | "bad_request" | "busy"
    message: str = ""
    payload: bytes = b""


Request = Begin | Finish | Fetch | Write | Pack | GetMetadata | Reserve | HoldPrefix

ERRORS: dict[str, type[TransferError]] = {
    "expired": LeaseExpiredError,
    "freed": BlocksFreedError,
    "compat": CompatError,
    "bad_request": TransferError,
    "busy": PeerBusyError,
}


def raise_for(reply: Reply) -> Reply:
    if not reply.ok:
        raise ERRORS.get(reply.error, TransferError)(reply.message)
    return reply
