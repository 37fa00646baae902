"""A streamed completion's bytes: its server-sent events encoded in compiled code (msgspec), and the
ASGI response that writes them.

Every chunk of one response shares its envelope (id, object, created, model), so that part is encoded
once per request and each event encodes only its choice. The response writes each item of its iterator
with one `send` (the caller joins events that are ready together into one item, so several tokens cost
one write), and watches the client through the request's own disconnect future instead of a task group
per response, as Starlette's StreamingResponse runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from dynamo_pd.frontend.openai import chunk_envelope

DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.encode
_EMPTY_CHOICE = b"{}]}"  # how the envelope of an empty choice ends


class Chunks:
    """The `data:` events of one streamed response."""

    def __init__(self, kind: str, rid: str, model: str) -> None:
        whole = _encode(chunk_envelope(kind, rid, model, {}))  # "choices" is its last key
        self._head = b"data: " + whole[:-len(_EMPTY_CHOICE)]  # ... "choices":[

    def choice(self, choice: dict[str, Any]) -> bytes:
        return self._head + _encode(choice) + b"]}\n\n"

    def usage(self, usage: dict[str, Any]) -> bytes:
        """The usage chunk: no choice, the request's usage."""
        return self._head + b'],"usage":' + _encode(usage) + b"}\n\n"


class EventStream(Response):
    """text/event-stream from `events`; when `gone` (the request's disconnect watch) completes, the
    stream is cancelled where it waits, so closing it cancels the request on every worker."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], gone: asyncio.Future,
                 headers: Mapping[str, str]) -> None:
        self.events, self.gone = events, gone
        self.status_code, self.background = 200, None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()

        def left(gone: asyncio.Future) -> None:
            if not gone.cancelled():
                task.cancel()

        self.gone.add_done_callback(left)
        try:
            start = {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            await send(start)
            async for data in self.events:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not self.gone.done() or self.gone.cancelled():
                raise
            task.uncancel()  # the client left: nothing is owed to anyone
        finally:
            self.gone.remove_done_callback(left)
            self.gone.cancel()
            await self.events.aclose()
