"""The one way to send on an asyncio ZMQ socket without awaiting."""

from __future__ import annotations

import zmq
import zmq.asyncio


def send_now(sock: zmq.asyncio.Socket, frames: list) -> None:
    """Send `frames` at once or raise zmq.ZMQError (EAGAIN when the peer's queue is full).

    Through the asyncio socket, never a sync shadow of it: ZMQ's FD is edge-triggered, and a send
    can consume the edge that would wake a pending recv. pyzmq re-checks after its own sends; a
    shadow's send skips that, and the reader then sleeps forever with replies waiting.
    """
    sent = sock.send_multipart(frames, flags=zmq.NOBLOCK)
    if sent.done() and sent.exception() is not None:
        raise sent.exception()
