"""kv_transfer: KV-cache block layouts, converters and transports (NIXL, ZMQ, in-process) for
handing prefilled KV blocks from one worker to another. A library: imports nothing from dynamo_pd.

    from kv_transfer import KVTransferAgent, KVMemory, TransferConfig
    agent = await KVTransferAgent("prefill-0", KVMemory.native(kv_cache, model), TransferConfig("zmq")).start()

See kv_transfer.agent for the hand-off protocol, kv_transfer.layout for layouts.
"""

import importlib

# name -> its module, imported on first use: `import kv_transfer.protocol` (the frontend, for the hand-off
# types) must not load the agent and its transports, which bring torch
_EXPORTS = {
    "KVTransferAgent": "agent", "copy_tokens": "convert", "ENGINE_LAYOUTS": "layout", "KVLayout": "layout",
    "KVMemory": "memory", "TransferConfig": "config", **{name: "protocol" for name in (
        "BlocksFreedError", "CompatError", "LeaseExpiredError", "PeerLostError", "ReleaseReason",
        "TransferDescriptor", "TransferError")},
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kv_transfer' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kv_transfer.{_EXPORTS[name]}"), name)
