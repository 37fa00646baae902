"""The KV hand-off's kinds: what protocol.py's structs carry. The work is dynamo_pd.handoff's.

Kinds (a tagged union, `Handoff`; each carries only its fields):
  HeldKV         engine -> its own worker only: a PREFILL engine keeps the prompt's KV in these blocks
                 until `release_handoff`; the worker's HandoffManager turns it into a pull or a push.
  PullHandoff    the prefill's first output carries it: the prefill's KV transfer agent holds the blocks
                 (`descriptor` says where) and the decode worker reads the ones it lacks (native, mocker;
                 vLLM / TensorRT-LLM / Dynamo style).
  PushHandoff    the frontend sends it to prefill and decode together, under the request id (the "room"):
                 the decode worker reserves blocks and tells the prefill's agent at `peer_endpoint`; the
                 prefill writes its KV and first token into them (SGLang style; native, mocker).
  EngineHandoff  the engine moves KV itself; `params` is its own state: vLLM's kv_transfer_params,
                 returned by prefill (pull-like); SGLang's bootstrap host/port (the room is the request
                 id), registered and sent to both sides at once (push-like); TensorRT-LLM's opaque
                 DisaggregatedParams returned by prefill (pull-like).

Below protocol.py: it imports neither protocol.py nor the KV transfer agent (only its wire structs).
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from kv_transfer.protocol import TransferDescriptor


class HeldKV(msgspec.Struct, tag="held", kw_only=True):
    """PREFILL engine -> its worker: the prompt's KV sits in these engine blocks until release_handoff."""

    first_token_from_decode: ClassVar[bool] = False

    request_id: str
    block_ids: list[int]  # in prompt order
    num_tokens: int  # prompt tokens whose KV the blocks hold


class PullHandoff(msgspec.Struct, tag="pull", kw_only=True):
    """The prefill's agent holds the blocks; the decode worker reads them."""

    # decode echoes the prefill's token (request.first_token_id)
    first_token_from_decode: ClassVar[bool] = False

    descriptor: TransferDescriptor  # request id, blocks, token count, layout and lease of the hold
    worker_id: str  # the prefill worker

    @property
    def request_id(self) -> str:
        return self.descriptor.request_id

    @property
    def num_tokens(self) -> int:
        return self.descriptor.num_tokens


class PushHandoff(msgspec.Struct, tag="push", kw_only=True):
    """The decode worker reserves blocks under `request_id` and the prefill writes into them."""

    # the prefill's token arrives with the KV; decode echoes it
    first_token_from_decode: ClassVar[bool] = False

    worker_id: str  # the prefill worker
    peer_endpoint: str  # its KV agent's side channel
    request_id: str = ""  # the room both sides key on; "" in a registered offer
    num_tokens: int = 0
    wait_s: float = 0.0  # how long the prefill may take before it writes (the frontend's bound on it)

    def for_request(self, request_id: str, num_tokens: int, wait_s: float) -> PushHandoff:
        return msgspec.structs.replace(self, request_id=request_id, num_tokens=num_tokens, wait_s=wait_s)


class EngineHandoff(msgspec.Struct, tag="engine", kw_only=True):
    """The engine moves KV itself; the worker and frontend carry `params` without reading them."""

    params: dict[str, Any] = {}
    worker_id: str = ""  # the prefill worker
    request_id: str = ""  # set per request when sent as a registered offer
    wait_s: float = 0.0  # offer: how long the decode side may wait for the prefill's KV
    first_token_from_decode: bool = True  # vLLM samples the first token again from the pulled KV

    def for_request(self, request_id: str, num_tokens: int, wait_s: float) -> EngineHandoff:
        return msgspec.structs.replace(self, request_id=request_id, wait_s=wait_s)


Handoff = HeldKV | PullHandoff | PushHandoff | EngineHandoff
HandoffOffer = PushHandoff | EngineHandoff  # what a prefill worker may register: sent to both sides at once


class TransferStats(msgspec.Struct, array_like=True):
    """DECODE role, first output: the KV this request moved and how long it took."""

    nbytes: int
    seconds: float
