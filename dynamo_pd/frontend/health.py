"""Health checks: every `interval_s`, a canary request to every worker that serves requests (a
one-token prompt, one token generated, greedy, as Dynamo's per-engine health-check payloads are).
A worker whose canary errors or takes over `timeout_s` leaves routing (ModelView.exclude: to its
model's backend it looks like the worker leaving) and is readmitted when a canary passes again.
A canary that only ran out of time on a worker that streamed other requests' outputs meanwhile passes: the
worker is busy (a batch-1 engine queues the canary behind them), not hung, and taking the last busy worker
out of routing would turn load into 503s. Canaries go on a client of their own, so an excluded worker is
still reached."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import msgspec

from dynamo_pd.protocol import EngineOutput, EngineRequest, SamplingParams, StopConditions, WorkerInfo
from dynamo_pd.runtime import FirstResponseTimeoutError, RequestContext, RpcClient
from router.worker import Role

if TYPE_CHECKING:
    from dynamo_pd.frontend.gateway import Gateway, ModelEntry

log = logging.getLogger("dynamo_pd.frontend")
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EngineOutput)
Verdict = Literal["passed", "failed", "timed out"]


@dataclass(frozen=True)
class HealthConfig:
    interval_s: float = 10.0  # 0: no health checks
    timeout_s: float = 10.0  # a canary slower than this fails (a loaded worker still answers one token sooner)


class HealthChecker:
    def __init__(self, gateway: Gateway):
        self.gateway = gateway
        self.rpc = RpcClient()
        self._checked: set[tuple[str, str]] = set()  # (model, worker) with a dynamo_pd_worker_healthy gauge

    async def run(self) -> None:
        while True:
            config = self.gateway.health  # read each round: a reloaded configuration applies at the next
            started = time.monotonic()
            if config.interval_s > 0:
                await self.check_all(config.timeout_s)
            await asyncio.sleep(max((config.interval_s or 1.0) - (time.monotonic() - started), 0.0))

    async def close(self) -> None:
        await self.rpc.close()

    async def check_all(self, timeout_s: float) -> None:
        checks = [(entry, info) for entry in self.gateway.models.values() if entry.backend is not None
                  for info in list(entry.view.members.values()) if info.role is not Role.PREFILL]
        started = time.monotonic()
        verdicts = await asyncio.gather(*(self._canary(entry, info, timeout_s) for entry, info in checks))
        metrics, now = self.gateway.metrics, set()
        for (entry, info), verdict in zip(checks, verdicts):
            if info.worker_id not in entry.view.members:  # it left while checked
                continue
            ok = verdict == "passed" or (verdict == "timed out" and
                                         entry.backend.last_output.get(info.worker_id, 0.0) > started)
            now.add((entry.name, info.worker_id))
            excluded = info.worker_id in entry.view.excluded
            if not ok and not excluded:
                log.warning("worker %s (model %r) failed its health check; out of routing until it passes",
                            info.worker_id, entry.name)
                entry.view.exclude(info.worker_id)
            elif ok and excluded:
                log.info("worker %s (model %r) passes its health check again; back in routing",
                         info.worker_id, entry.name)
                entry.view.readmit(info.worker_id)
            if metrics is not None:
                metrics.worker_healthy.labels(entry.name, info.worker_id).set(1 if ok else 0)
                if not ok:
                    metrics.health_failures.labels(entry.name, info.worker_id).inc()
        if metrics is not None:
            for model, worker_id in self._checked - now:  # workers gone: their gauge with them
                metrics.worker_healthy.remove(model, worker_id)
        self._checked = now

    async def _canary(self, entry: ModelEntry, info: WorkerInfo, timeout_s: float) -> Verdict:
        rid = f"health-{info.worker_id}-{time.monotonic_ns()}"
        prompt = entry.backend.tokenizer("Hi").input_ids[-1:] if entry.backend.tokenizer is not None else [1]
        request = EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling=SamplingParams(temperature=0.0),
                                stop=StopConditions(max_tokens=1, ignore_eos=True), probe=True)
        context = RequestContext(rid)
        try:
            async with asyncio.timeout(timeout_s):
                async for chunk in self.rpc.stream(info.rpc_endpoint, _encoder.encode(request), context,
                                                   first_response_timeout_s=timeout_s):
                    out = _decoder.decode(chunk)
                    if out.finish_reason is not None:
                        return "failed" if out.finish_reason == "error" else "passed"
            return "failed"
        except (TimeoutError, FirstResponseTimeoutError):
            log.debug("health check of %s timed out after %.1fs", info.worker_id, timeout_s)
            return "timed out"
        except Exception as exc:  # noqa: BLE001 - any failure of the canary is the verdict
            log.debug("health check of %s failed: %s", info.worker_id, exc)
            return "failed"
        finally:
            context.cancel()
