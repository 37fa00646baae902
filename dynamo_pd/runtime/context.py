"""RequestContext: per-request control shared by a caller, the request plane and the engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from dynamo_pd.runtime.tasks import cancel_and_wait

T = TypeVar("T")


class RequestContext:
    """Cancellation: the caller (or the RPC server, for a client gone) cancels, the engine aborts. In the
    frontend it also names the worker the router placed the request on (the x-dynamo-pd-worker header).
    `metadata` is what the request carries across processes besides its payload (the RPC client sends it
    with the call, the server's context has it; W3C trace headers, dynamo_pd.tracing): strings, {} if none."""

    def __init__(self, request_id: str, metadata: dict[str, str] | None = None):
        self.request_id = request_id
        self.worker_id: str | None = None
        self.metadata: dict[str, str] = metadata or {}
        self._cancelled = asyncio.Event()
        self._on_cancel: list[Callable[[], None]] = []

    def cancel(self) -> None:
        if self._cancelled.is_set():
            return
        self._cancelled.set()
        for callback in self._on_cancel:
            callback()

    def on_cancel(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` (on this loop, at once) when the context is cancelled, or now if it is already.
        Returns what removes it: a waiter that watches cancellation without a task of its own."""
        if self.cancelled:
            callback()
        self._on_cancel.append(callback)
        return lambda: self._on_cancel.remove(callback)

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    async def wait_cancelled(self) -> None:
        await self._cancelled.wait()

    async def until_cancelled(self, stream: AsyncIterator[T]) -> AsyncIterator[T | None]:
        """`stream`'s items until it ends, or a None (and nothing after it) once this context is cancelled.
        A step still waiting on `stream` is cancelled and waited for before that None and before this
        generator closes: an engine's stream may be aborted or closed only while nothing runs it (an async
        generator refuses aclose() while a step is running; vLLM aborts a request whose step is cancelled)."""
        cancelled = asyncio.ensure_future(self.wait_cancelled())
        step: asyncio.Future | None = None
        try:
            while True:
                step = asyncio.ensure_future(anext(stream))
                await asyncio.wait({step, cancelled}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    await cancel_and_wait([step])
                    yield None
                    return
                try:
                    item = step.result()
                except StopAsyncIteration:
                    return
                yield item
        finally:
            await cancel_and_wait([cancelled, *([step] if step is not None else [])])
