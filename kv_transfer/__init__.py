"""kv_transfer: KV-cache block layouts, converters and transports (NIXL, ZMQ, in-process) for
handing prefilled KV blocks from one worker to another. A library: imports nothing from dynamo_pd.

    from kv_transfer import KVTransferAgent, KVMemory, TransferConfig
    agent = await KVTransferAgent("prefill-0", KVMemory.native(kv_cache, model), TransferConfig("zmq")).start()

See kv_transfer.agent for the hand-off protocol, kv_transfer.layout for layouts.
"""

from kv_transfer.agent import KVTransferAgent
from kv_transfer.convert import copy_tokens
from kv_transfer.layout import ENGINE_LAYOUTS, KVLayout
from kv_transfer.memory import KVMemory
from kv_transfer.protocol import (
    BlocksFreedError, CompatError, LeaseExpiredError, PeerLostError, ReleaseReason, TransferDescriptor,
    TransferError,
)
from kv_transfer.transports import TransferConfig

__all__ = [
    "ENGINE_LAYOUTS", "BlocksFreedError", "CompatError", "KVLayout", "KVMemory", "KVTransferAgent",
    "LeaseExpiredError", "PeerLostError", "ReleaseReason", "TransferConfig", "TransferDescriptor",
    "TransferError", "copy_tokens",
]
