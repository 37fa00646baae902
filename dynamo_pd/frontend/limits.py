"""Rate limits and admission: token buckets per API key and per model, in requests/s and in
tokens/s (prompt + max_tokens), and a cap on each model's queued requests (waiting for their first
token). A refused request is a 429 with Retry-After (limits) or a 503 (queue full).

A request is checked against every bucket it falls in before any is charged, so one refused
request costs no bucket anything. A bucket holds `burst_s` seconds of its rate; a request whose
tokens exceed that much waits for a full bucket and then leaves it in debt (it still runs once).
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

from dynamo_pd.frontend.gateway_metrics import GatewayMetrics
from dynamo_pd.protocol import EngineOutput


class RateLimitedError(RuntimeError):
    def __init__(self, message: str, retry_after_s: float, limit: str):
        super().__init__(message)
        self.retry_after_s, self.limit = retry_after_s, limit

    @property
    def retry_after(self) -> str:
        return str(max(1, math.ceil(self.retry_after_s)))


class QueueFullError(RuntimeError):
    """The model's queue of requests waiting for a first token is at its cap (HTTP 503)."""


@dataclass(frozen=True)
class Limit:
    requests_per_s: float = 0.0  # 0: unlimited
    tokens_per_s: float = 0.0


class TokenBucket:
    def __init__(self, rate: float, burst_s: float, now: float):
        self.rate, self.burst_s, self.capacity = rate, burst_s, max(rate * burst_s, 1.0)
        self.level, self._last = self.capacity, now

    def wait_s(self, cost: float, now: float) -> float:
        """Seconds until `cost` may be taken (0: now)."""
        self.level = min(self.capacity, self.level + (now - self._last) * self.rate)
        self._last = now
        need = min(cost, self.capacity)
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def take(self, cost: float) -> None:
        self.level -= cost


@dataclass
class LimitsConfig:
    per_key: Limit = Limit()  # every API key (or client address, without one) its own buckets
    per_model: Limit = Limit()  # every model its own buckets
    keys: dict[str, Limit] | None = None  # overrides by API key
    models: dict[str, Limit] | None = None  # overrides by model
    burst_s: float = 1.0
    max_queued: int = 0  # per model; 0: unlimited


class Limiter:
    def __init__(self, config: LimitsConfig, metrics: GatewayMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.config, self.metrics, self._clock = config, metrics, clock
        self._buckets: dict[tuple[str, str, str], TokenBucket] = {}
        self.queued: dict[str, int] = {}

    def check(self, key: str, model: str, requests: int = 0, tokens: int = 0) -> None:
        """Charge `requests` and `tokens` to the key's and the model's buckets, or raise RateLimitedError."""
        cfg, now = self.config, self._clock()
        scopes = (("key", key, (cfg.keys or {}).get(key, cfg.per_key)),
                  ("model", model, (cfg.models or {}).get(model, cfg.per_model)))
        charges = []
        for scope, name, limit in scopes:
            for unit, rate, cost in (
                ("requests", limit.requests_per_s, requests),
                ("tokens", limit.tokens_per_s, tokens),
            ):
                if rate > 0 and cost > 0:
                    bucket = self._buckets.get((scope, name, unit))
                    if bucket is None or (bucket.rate, bucket.burst_s) != (rate, cfg.burst_s):  # new, or reloaded
                        bucket = self._buckets[(scope, name, unit)] = TokenBucket(rate, cfg.burst_s, now)
                    wait = bucket.wait_s(cost, now)
                    if wait > 0:
                        if self.metrics is not None:
                            self.metrics.rate_limited.labels(model, f"{scope}_{unit}").inc()
                        who = "this API key" if scope == "key" else f"model {model!r}"
                        raise RateLimitedError(f"rate limit of {rate:g} {unit}/s for {who} reached; retry in "
                                               f"{wait:.1f}s", wait, f"{scope}_{unit}")
                    charges.append((bucket, cost))
        for bucket, cost in charges:
            bucket.take(cost)

    def enqueue(self, model: str) -> None:
        """A request of `model` waits for its first token (release it with `dequeue`), or QueueFullError."""
        cap, waiting = self.config.max_queued, self.queued.get(model, 0)
        if cap and waiting >= cap:
            if self.metrics is not None:
                self.metrics.queue_full.labels(model).inc()
            raise QueueFullError(f"model {model!r} has {waiting} requests waiting for their first token, its cap "
                                 f"(--max-queued-requests); retry later")
        self.queued[model] = waiting + 1

    def dequeue(self, model: str) -> None:
        self.queued[model] -= 1


def client_key(headers: Mapping[str, str], address: str) -> str:
    """Whom per-key limits count: the API key presented, else the client's address."""
    auth = headers.get("authorization", "")
    return auth.removeprefix("Bearer ") if auth else f"address:{address}"


async def queued(stream: AsyncIterator[EngineOutput], limiter: Limiter, model: str) -> AsyncIterator[EngineOutput]:
    """`stream`, counted in its model's queue until its first output (QueueFullError when full)."""
    limiter.enqueue(model)  # here, not before: only a started generator runs its finally
    waiting = True
    try:
        async for out in stream:
            if waiting:
                waiting = False
                limiter.dequeue(model)
            yield out
    finally:
        if waiting:
            limiter.dequeue(model)
        await stream.aclose()
