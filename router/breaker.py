"""A circuit breaker per worker, as a gateway ejects a failing endpoint: a worker that failed a request
stays out of routing for `base_s`, doubling with each failure in a row up to `max_s`; a success resets it.
KvRouter routes around open breakers unless every worker of the pool is out (then it tries them anyway,
as a gateway's maximum ejection share keeps some endpoints in)."""

from __future__ import annotations

import time
from collections.abc import Callable


class CircuitBreaker:
    def __init__(self, base_s: float = 1.0, max_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        if not 0 < base_s <= max_s:
            raise ValueError(f"need 0 < base_s <= max_s, got {base_s} and {max_s}")
        self.base_s, self.max_s, self._clock = base_s, max_s, clock
        self._failures: dict[str, int] = {}  # failures in a row
        self._until: dict[str, float] = {}  # out of routing until then

    def failed(self, worker_id: str) -> float:
        """Record a failure; returns how long the worker stays out."""
        n = self._failures[worker_id] = self._failures.get(worker_id, 0) + 1
        out = min(self.base_s * 2 ** (n - 1), self.max_s)
        self._until[worker_id] = self._clock() + out
        return out

    def succeeded(self, worker_id: str) -> None:
        self._failures.pop(worker_id, None)
        self._until.pop(worker_id, None)

    def is_open(self, worker_id: str) -> bool:
        """True while the worker is kept out of routing."""
        return self._until.get(worker_id, 0.0) > self._clock()

    forget = succeeded  # the worker left: nothing to remember
