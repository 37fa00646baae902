"""The planner's loop: every interval observe, predict, model, decide, and have the connector carry it out.

Before it models the next interval, it checks the model against the one that ended: what the requests that
ended in it measured (the median TTFT and ITL, OFFSET_MIN_REQUESTS at least; the ITL at the attainment
quantile, from enough requests to have a few beyond it), minus what the model gives for that interval's own
arrivals, its state at the start and its workers, is what the model misses; an exponentially weighted mean
of it (OFFSET_WEIGHT) is added to what the model predicts (model.Offsets).

Each decision is one log line with its reason (WARNING when the SLO cannot be met), the metrics of
dynamo_pd.planner.metrics and, with --planner-record, a JSON line. A pool whose last scaling call is still
running is held (its count already includes the workers starting); a call that fails is logged, counted
and, since the pool is as it was, decided again at the next interval.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import statistics
import time
from collections.abc import Callable

from dynamo_pd.planner.config import PlannerConfig
from dynamo_pd.planner.connectors import Connector, ConnectorError
from dynamo_pd.planner.decide import Decision, PoolPlan, Slo, decide
from dynamo_pd.planner.metrics import PlannerMetrics
from dynamo_pd.planner.model import Costs, Limits, Load, Offsets, PoolModel, State
from dynamo_pd.planner.observe import Observer, PoolObservation
from dynamo_pd.planner.predict import LoadForecast

log = logging.getLogger("dynamo_pd.planner")

OFFSET_MIN_REQUESTS = 5  # an interval's measured median counts from this many requests
OFFSET_WEIGHT = 0.5  # the newest interval's weight in an offset


class Planner:
    def __init__(self, config: PlannerConfig, observer: Observer, connector: Connector,
                 metrics: PlannerMetrics, clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.observer, self.connector, self.metrics = config, observer, connector, metrics
        metrics.count_worker_seconds(connector.worker_seconds)
        self._clock = clock
        self.forecasts = {pool: LoadForecast(config.predictor) for pool in config.pools}
        self._limits: dict[str, Limits] = {}  # last known, kept while a pool has no worker
        self._last_growth: dict[str, float] = {}  # the cool-down's start: a shrink after a shrink is no flap
        self._scaling: dict[str, asyncio.Task] = {}
        # per pool, how long its last growth took until the new workers registered (one interval until seen)
        self._ready_s: dict[str, float] = {}
        self._slo = Slo(config.ttft_slo_s, config.itl_slo_s)
        self._state: dict[str, State] = {}  # per pool, at the start of the interval now ending
        self.offsets: dict[str, Offsets] = {}

    async def run(self) -> None:
        self.observer.collect(self.config.pools)  # the first interval starts now
        while True:
            await asyncio.sleep(self.config.interval_s)
            await self.step()

    async def step(self) -> list[Decision]:
        observations = self.observer.collect(self.config.pools)
        for pool, seen in observations.items():
            self.forecasts[pool].update(seen.interval_s, list(seen.arrivals))
        try:
            current = await self.connector.replicas()
        except ConnectorError as exc:
            log.error("planner: cannot read the pools' sizes (%s); trying again in %g s", exc,
                      self.config.interval_s)
            for pool in self.config.pools:
                self.metrics.connector_errors.labels(pool).inc()
            return []
        plans, loads = [], {}
        for pool in self.config.pools:
            plan, loads[pool] = self._plan(observations[pool], current[pool])
            plans.append(plan)
        decisions = decide(plans, self.config.budget, self._slo, self.config.cooldown_s, self._clock())
        for decision in decisions:
            seen = observations[decision.pool]
            log.log(logging.WARNING if decision.unmeetable else logging.INFO,
                    "planner %s: %s (%d requests in %.0f s%s)", decision.pool, decision.reason,
                    len(seen.arrivals), seen.interval_s, self._measured(seen))
            self.metrics.record(decision, loads[decision.pool], len(seen.workers), _median(seen.ttfts),
                                _median(seen.itls))
            if decision.change:
                self._scale(decision)
        if self.config.record is not None:
            self._record(decisions, observations, loads, {p.pool: p.model for p in plans})
        return decisions

    def _plan(self, seen: PoolObservation, current: int) -> tuple[PoolPlan, Load | None]:
        pool, cfg = seen.pool, self.config
        prefills, decodes = pool != "decode", pool != "prefill"
        if seen.workers and seen.block_size:
            self._limits[pool] = Limits(seen.max_num_seqs or 1 << 30, seen.kv_blocks or 1 << 30,
                                        seen.block_size, cfg.chunk_tokens)
        costs = seen.costs
        state, self._state[pool] = self._state.get(pool, State()), State(seen.queued_prefill_tokens, seen.running)
        ready = self._ready_s.get(pool, cfg.interval_s) / cfg.interval_s
        load = self.forecasts[pool].load(costs.output_tokens or 0.0, ready)
        missing = ("the last scaling to finish" if pool in self._scaling
                   else "a worker to register" if pool not in self._limits
                   else "an interval of load" if load is None
                   else "prefill step costs (a prompt served)" if prefills and (
                       costs.prefill_s_per_token is None)
                   else "decode step costs (a request served)" if decodes and (
                       costs.decode_s is None or costs.output_tokens is None)
                   else "")
        model = None
        if not missing:
            step = Costs(costs.prefill_s_per_token or 0.0, costs.decode_s or 0.0,
                         costs.decode_s_per_block or 0.0)
            model = PoolModel(step, load, self._state[pool], self._limits[pool], prefills=prefills,
                              decodes=decodes, horizon_s=cfg.interval_s, attainment=cfg.attainment)
            self._calibrate(seen, dataclasses.replace(model, load=_observed_load(seen, load), state=state))
            model = dataclasses.replace(model, offsets=self.offsets[pool])
        expected = None if model is None else dataclasses.replace(
            model, load=dataclasses.replace(load, rate=self.forecasts[pool].rate.forecast()))
        return PoolPlan(pool, current, cfg.min_workers(pool), cfg.max_workers(pool), model, missing,
                        self._last_growth.get(pool), expected), load

    def _calibrate(self, seen: PoolObservation, past: PoolModel) -> None:
        """Update the pool's offsets from the interval that ended, `past` its model (without offsets)."""
        o, n = self.offsets.get(seen.pool, Offsets()), len(seen.workers)
        if n and past.prefills and len(seen.ttfts) >= OFFSET_MIN_REQUESTS:
            o = dataclasses.replace(o, ttft_p50=_weigh(o.ttft_p50, _median(seen.ttfts) - past.ttft_p50(n)))
        if n and past.decodes and len(seen.itls) >= OFFSET_MIN_REQUESTS:
            mean, quantile = past.itl(n)
            o = dataclasses.replace(o, itl_mean=_weigh(o.itl_mean, _median(seen.itls) - mean))
            ranked = sorted(seen.itls)
            beyond = len(ranked) * (1 - past.attainment)  # requests past the quantile
            if beyond >= 2:
                measured = ranked[min(len(ranked) - 1, int(past.attainment * len(ranked)))]
                o = dataclasses.replace(o, itl_quantile=_weigh(o.itl_quantile, measured - quantile))
        self.offsets[seen.pool] = o

    def _measured(self, seen: PoolObservation) -> str:
        """The log line's account of what the interval's requests measured, and the offsets."""
        o, text = self.offsets.get(seen.pool, Offsets()), ""
        if seen.ttfts:
            text += f"; measured TTFT p50 {_median(seen.ttfts) * 1e3:.1f} ms over {len(seen.ttfts)} requests"
        if seen.itls:
            text += f"; measured ITL p50 {_median(seen.itls) * 1e3:.2f} ms over {len(seen.itls)}"
        known = [f"{what} {value * 1e3:+.2f} ms" for what, value in (
            ("TTFT", o.ttft_p50), ("ITL", o.itl_mean), ("ITL quantile", o.itl_quantile)) if value is not None]
        return text + (f"; offsets {', '.join(known)}" if known else "")

    def _scale(self, decision: Decision) -> None:
        if decision.change > 0:
            self._last_growth[decision.pool] = self._clock()
        task = asyncio.create_task(self._carry_out(decision))
        self._scaling[decision.pool] = task

    async def _carry_out(self, decision: Decision) -> None:
        started = self._clock()
        try:
            await self.connector.set_replicas(decision.pool, decision.target)  # growth: until they registered
            if decision.target > decision.current:
                self._ready_s[decision.pool] = self._clock() - started
        except ConnectorError as exc:
            self.metrics.connector_errors.labels(decision.pool).inc()
            if decision.change > 0:
                self._last_growth.pop(decision.pool, None)  # nothing grew: no cool-down either
            log.error("planner %s: scaling %d -> %d failed, the pool is as it was; deciding again in %g s: "
                      "%s", decision.pool, decision.current, decision.target, self.config.interval_s, exc)
        finally:
            self._scaling.pop(decision.pool, None)

    async def wait_scaling(self) -> None:
        """Until the scaling calls in flight have returned."""
        await asyncio.gather(*self._scaling.values(), return_exceptions=True)

    def _record(self, decisions: list[Decision], observations: dict[str, PoolObservation],
                loads: dict[str, Load | None], models: dict[str, PoolModel | None]) -> None:
        with self.config.record.open("a") as out:
            for d in decisions:
                seen, load, model = observations[d.pool], loads[d.pool], models[d.pool]
                prediction = None if d.prediction is None else {
                    k: None if v is None or math.isinf(v) else v for k, v in dataclasses.asdict(d.prediction).items()}
                out.write(json.dumps({
                    "time": time.time(), "pool": d.pool, "current": d.current, "target": d.target,
                    "registered": len(seen.workers), "arrivals": len(seen.arrivals),
                    "interval_s": seen.interval_s,
                    "queued_prefill_tokens": seen.queued_prefill_tokens, "running": seen.running,
                    "measured_ttft_p50": _median(seen.ttfts), "measured_itl_p50": _median(seen.itls),
                    "offsets": dataclasses.asdict(self.offsets.get(d.pool, Offsets())),
                    # what the model was given: enough to run it again on other arrivals (benchmarks.planner)
                    "costs": None if model is None else dataclasses.asdict(model.costs),
                    "limits": None if model is None else dataclasses.asdict(model.limits),
                    "predicted_rate": None if load is None else load.rate,  # planned for
                    "forecast_rate": self.forecasts[d.pool].rate.forecast(),
                    "rate_shortfall": self.forecasts[d.pool].shortfall,
                    "predicted_prompt_tokens": None if load is None else load.mean_prompt_tokens,
                    "prediction": prediction, "unmeetable": d.unmeetable, "reason": d.reason}) + "\n")


def _median(values: tuple[float, ...]) -> float | None:
    return statistics.median(values) if values else None


def _weigh(offset: float | None, error: float) -> float | None:
    """The offset after an interval whose measured median missed the model's by `error` (inf: the model
    says the pool could not keep up, which tells nothing of the offset)."""
    if not math.isfinite(error):
        return offset
    return error if offset is None else OFFSET_WEIGHT * error + (1 - OFFSET_WEIGHT) * offset


def _observed_load(seen: PoolObservation, planned: Load) -> Load:
    """The load the interval that ended had: its own arrivals (planned's lengths where it had none)."""
    if not seen.arrivals:
        return dataclasses.replace(planned, rate=0.0)
    tokens = tuple(a.prefill_tokens for a in seen.arrivals)
    return dataclasses.replace(planned, rate=len(tokens) / seen.interval_s, prompt_tokens=tokens,
                               prompt_blocks=sum(a.blocks for a in seen.arrivals) / len(tokens))
