"""The one way background tasks are stopped: cancel them all, then wait for each one's cleanup."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable


async def cancel_and_wait(tasks: Iterable[asyncio.Future]) -> None:
    """Cancel `tasks` and wait until each has finished; what they raised or returned is dropped
    (a stopped task's outcome no longer matters), but a cancellation of the caller propagates."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
