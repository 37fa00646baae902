"""Waiting in a test for what another task, thread or process does."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any


async def until(predicate: Callable[[], Any], what: str = "the condition", timeout_s: float = 20.0,
                poll_s: float = 0.01) -> None:
    """Poll `predicate` (its result may be awaitable) until it is true; AssertionError naming `what` once
    `timeout_s` passed (a caller probing in a loop catches it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        assert time.monotonic() < deadline, f"{what} not within {timeout_s} s"
        await asyncio.sleep(poll_s)


def wait(predicate: Callable[[], Any], what: str = "the condition", timeout_s: float = 20.0,
         poll_s: float = 0.1) -> None:
    """`until` for a test outside an event loop (one watching servers it started): an OSError counts as not
    yet (the server is not listening yet)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if predicate():
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"{what} not within {timeout_s} s"
        time.sleep(poll_s)
