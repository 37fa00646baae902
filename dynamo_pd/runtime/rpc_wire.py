"""Request-plane wire: a msgpack header frame, then the payload frame where there is one.

client DEALER -> server ROUTER:  [[Open | Cancel | Ping, ...], payload of each Open in order, ...]
server ROUTER -> client DEALER:  [[Data | End | Fail, ...], payload of each Data in order, ...]
`stream` numbers a client's streams; many share one connection. Each side sends what a turn of its loop
produced for one peer as one message (the server: a step's tokens for every stream of that client; the
client: the requests it opened on that worker): a ZMQ send costs far more than its bytes.
"""

from __future__ import annotations

import msgspec


class Open(msgspec.Struct, tag=True, omit_defaults=True):
    stream: int
    request_id: str
    metadata: dict[str, str] = {}  # RequestContext.metadata; not on the wire when empty


class Cancel(msgspec.Struct, tag=True):
    stream: int


class Ping(msgspec.Struct, tag=True):
    """Sent while the client has open streams; a client silent too long has its streams cancelled."""


class Data(msgspec.Struct, tag=True):
    stream: int


class End(msgspec.Struct, tag=True):
    stream: int


class Fail(msgspec.Struct, tag=True):
    stream: int
    error_type: str
    message: str
    client_error: bool = False  # an InvalidRequestError: the client's fault, not the worker's
    param: str | None = None  # ... and the request field it names


ToServer = Open | Cancel | Ping
ToClient = Data | End | Fail

encoder = msgspec.msgpack.Encoder()
server_decoder = msgspec.msgpack.Decoder(list[ToServer])
client_decoder = msgspec.msgpack.Decoder(list[ToClient])
