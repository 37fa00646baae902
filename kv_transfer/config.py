"""How an agent moves KV bytes: its transport, where it binds, its leases and timeouts. Apart from the
transports (torch, numpy) so a process that only describes hand-offs (the frontend) never loads them."""

from __future__ import annotations

from dataclasses import dataclass

from kv_transfer.side_channel import Guard, Plain

TRANSPORTS = ("nixl", "zmq", "inproc")


@dataclass(frozen=True)
class TransferConfig:
    """How an agent moves KV bytes; one per worker, from the worker's command line."""

    transport: str = "zmq"  # "nixl" | "zmq" | "inproc"
    endpoint: str = ""  # side channel bind address; "" = tcp://127.0.0.1:0 (inproc://kv-<engine> for inproc)
    advertise_host: str = ""  # the address peers reach the side channel at, when it binds a wildcard
    guard: Guard = Plain()  # secures the side channel's sockets (dynamo_pd: CURVE from the cluster secret)
    metadata_store: str = ""  # NIXL metadata: "" = over the side channel, "etcd://host:port" = etcd
    lease_s: float = 30.0  # how long held blocks wait for the peer
    timeout_s: float = 10.0  # longest silence tolerated from a peer during any call or transfer
    frame_bytes: int = 1 << 20  # ZMQ frame size
    reserve_s: float = 300.0  # push mode: longest an unclaimed Reserve is kept, whatever lease the peer set

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown KV transport {self.transport!r}; choose one of {TRANSPORTS}")
        if min(self.lease_s, self.timeout_s, self.frame_bytes, self.reserve_s) <= 0:
            raise ValueError(f"lease_s, timeout_s, frame_bytes and reserve_s must be positive: {self}")
