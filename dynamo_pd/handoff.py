"""The KV hand-off: how a prompt's KV gets from the prefill worker to the decode worker. One place.

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

How the frontend dispatches is what the prefill worker registered (`WorkerInfo.handoff_offer`), never an
engine name: no offer -> send the decode request after the prefill's first output, with the hand-off that
output carries; an offer -> `offer.for_request(...)` goes to prefill and decode at once. Whose first token
the client gets is the hand-off's `first_token_from_decode`.

Times: every lease and timeout of a hand-off comes from HandoffTimes (the user's --handoff-lease-s and the
KV transfer timeout) and `together_timeouts` (the frontend's first-response bound).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec

from kv_transfer.protocol import TransferDescriptor
from kv_transfer.transports import TransferConfig


class HeldKV(msgspec.Struct, tag="held", kw_only=True):
    """PREFILL engine -> its worker: the prompt's KV sits in these engine blocks until release_handoff."""

    first_token_from_decode: ClassVar[bool] = False

    request_id: str
    block_ids: list[int]  # in prompt order
    num_tokens: int  # prompt tokens whose KV the blocks hold


class PullHandoff(msgspec.Struct, tag="pull", kw_only=True):
    """The prefill's agent holds the blocks; the decode worker reads them."""

    first_token_from_decode: ClassVar[bool] = False  # decode echoes the prefill's token (request.first_token_id)

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

    first_token_from_decode: ClassVar[bool] = False  # the prefill's token arrives with the KV; decode echoes it

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


@dataclass(frozen=True)
class HandoffTimes:
    """Every lease and timeout of a hand-off, from the user's --handoff-lease-s and the transfer timeout.

    A pull hold ends by its lease, or later by the one transfer it was pinned for: the holder keeps
    pinned blocks for the reader's timeout (capped by its own) plus its own (kv_transfer.agent, Begin).
    The engine's own lease is only the backstop for a release that never comes: it outlasts that."""

    lease_s: float = 30.0  # --handoff-lease-s: how long held KV waits for the decode side
    transfer_timeout_s: float = TransferConfig.timeout_s  # longest silence from a peer in one transfer

    def __post_init__(self) -> None:
        if not (self.lease_s > 0 and self.transfer_timeout_s > 0):
            raise ValueError(f"hand-off lease and transfer timeout must be positive: {self}")

    @property
    def hold_s(self) -> float:
        """The longest a pull hold can last: the worker waits this long for its release."""
        return self.lease_s + 2 * self.transfer_timeout_s

    @property
    def engine_lease_s(self) -> float:
        """PREFILL engine: frees held blocks itself after this (the agent has released them by then)."""
        return self.hold_s + self.transfer_timeout_s

    @property
    def drain_s(self) -> float:
        """DECODE, push: a write in flight may go on this long after the hold is given up."""
        return 2 * self.transfer_timeout_s

    def reserve_lease_s(self, handoff: PushHandoff) -> float:
        """DECODE, push: reserved blocks wait for the prefill's bound, then the usual lease."""
        return handoff.wait_s + self.lease_s

    def load_timeout_s(self, handoff: Handoff) -> float:
        """DECODE engine: the longest its kv_loader may take."""
        return self.lease_s + (handoff.wait_s if isinstance(handoff, PushHandoff | EngineHandoff) else 0.0)

    def transfer_config(self, transport: str) -> TransferConfig:
        return TransferConfig(transport, lease_s=self.lease_s, timeout_s=self.transfer_timeout_s)


def together_timeouts(first_response_s: float) -> tuple[float, float]:
    """Frontend, an offered hand-off: (how long the decode side waits for the prefill's KV, how long the
    frontend waits for the decode stream's first output) from its own first-response bound."""
    return first_response_s, 2 * first_response_s
