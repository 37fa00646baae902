"""Inbox: one stream's items as their producer delivers them, and the one task waiting for them.

A list and a future, where an asyncio.Queue waited on beside a cancellation (ensure_future of each, then
asyncio.wait) cost two tasks per item: the request plane's client and the engines' request streams wait
through it once per token.
"""

from __future__ import annotations

import asyncio


class Inbox:
    __slots__ = ("items", "_waiter")

    def __init__(self) -> None:
        self.items: list = []
        self._waiter: asyncio.Future | None = None

    def put(self, item) -> None:
        self.items.append(item)
        self.wake()

    def wake(self) -> None:
        """Return the waiting task from wait() without an item (something else it watches changed)."""
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self, timeout_s: float | None) -> bool:
        """Until an item arrives or wake() (True), or `timeout_s` passes (False)."""
        if self.items:
            return True
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(timeout_s):
                await self._waiter
            return True
        except TimeoutError:
            return False
        finally:
            self._waiter = None

    def take(self) -> list:
        items, self.items = self.items, []
        return items
