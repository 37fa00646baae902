"""RequestContext: per-request control shared by a caller, the request plane and the engine."""

from __future__ import annotations

import asyncio


class RequestContext:
    """Cancellation, for now: the caller (or the RPC server, for a client gone) cancels, the engine aborts."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._cancelled = asyncio.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    async def wait_cancelled(self) -> None:
        await self._cancelled.wait()
