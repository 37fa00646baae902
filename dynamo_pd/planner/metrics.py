"""The planner's Prometheus metrics, every series labelled by pool.

  dynamo_pd_planner_predicted_requests_per_second    the arrival rate planned for (the forecast with its
                                                     margins, dynamo_pd.planner.predict)
  dynamo_pd_planner_predicted_prompt_tokens          its mean uncached prompt tokens per request
  dynamo_pd_planner_predicted_ttft_seconds           the predicted median TTFT at the chosen count (these
                                                     four at the rate forecast, without the margins)
  dynamo_pd_planner_predicted_ttft_attainment        the predicted share of requests within --ttft-slo
  dynamo_pd_planner_predicted_itl_seconds            the predicted mean ITL
  dynamo_pd_planner_predicted_itl_quantile_seconds   the predicted ITL at the --slo-attainment quantile
  dynamo_pd_planner_measured_ttft_seconds            the median TTFT of the requests that ended in the
                                                     interval (as their frontends measured it)
  dynamo_pd_planner_measured_itl_seconds             their median ITL
  dynamo_pd_planner_replicas                         the count chosen (serving and starting workers)
  dynamo_pd_planner_registered_workers               workers registered in discovery
  dynamo_pd_planner_decisions_total{action}          up, down, hold
  dynamo_pd_planner_slo_unmeetable                   1 while the SLO cannot be met within the limits and
                                                     budget (the planner holds their maximum), else 0
  dynamo_pd_planner_slo_unmeetable_intervals_total   intervals that were so
  dynamo_pd_planner_connector_errors_total           scaling calls that failed (retried next interval)
  dynamo_pd_planner_worker_seconds_total             seconds its workers existed (the local connector)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from dynamo_pd.planner.decide import Decision
from dynamo_pd.planner.model import Load

_P = "dynamo_pd_planner_"


class PlannerMetrics:
    def __init__(self, pools: tuple[str, ...]) -> None:
        self.registry = r = CollectorRegistry()

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(_P + name, doc, ["pool"], registry=r)

        self.rate = gauge("predicted_requests_per_second", "Arrival rate planned for, next interval")
        self.prompt_tokens = gauge("predicted_prompt_tokens", "Predicted uncached prompt tokens a request")
        self.ttft = gauge("predicted_ttft_seconds", "Predicted median TTFT at the chosen worker count")
        self.ttft_attainment = gauge("predicted_ttft_attainment", "Predicted share within the TTFT SLO")
        self.itl = gauge("predicted_itl_seconds", "Predicted mean ITL at the chosen worker count")
        self.itl_quantile = gauge("predicted_itl_quantile_seconds", "Predicted ITL at the SLO's quantile")
        self.measured_ttft = gauge("measured_ttft_seconds", "Median TTFT of the requests ended, last interval")
        self.measured_itl = gauge("measured_itl_seconds", "Median ITL of the requests ended, last interval")
        self.replicas = gauge("replicas", "Workers chosen (serving and starting)")
        self.registered = gauge("registered_workers", "Workers registered in discovery")
        self.unmeetable = gauge("slo_unmeetable", "1 while the SLO cannot be met within limits and budget")
        self.decisions = Counter(_P + "decisions", "Decisions", ["pool", "action"], registry=r)
        self.unmeetable_total = Counter(_P + "slo_unmeetable_intervals", "Intervals the SLO could not be met",
                                        ["pool"], registry=r)
        self.connector_errors = Counter(_P + "connector_errors", "Scaling calls that failed", ["pool"],
                                        registry=r)
        for pool in pools:  # rendered from the start: none is a count
            for action in ("up", "down", "hold"):
                self.decisions.labels(pool, action)
            for family in (self.unmeetable, self.unmeetable_total, self.connector_errors):
                family.labels(pool)

    def record(self, decision: Decision, load: Load | None, registered: int, ttft_s: float | None = None,
               itl_s: float | None = None) -> None:
        """`ttft_s`, `itl_s`: measured over the interval (None: no request ended there)."""
        pool = decision.pool
        for gauge, value in ((self.measured_ttft, ttft_s), (self.measured_itl, itl_s)):
            if value is not None:
                gauge.labels(pool).set(value)
        action = "up" if decision.change > 0 else "down" if decision.change < 0 else "hold"
        self.decisions.labels(pool, action).inc()
        self.replicas.labels(pool).set(decision.target)
        self.registered.labels(pool).set(registered)
        self.unmeetable.labels(pool).set(1 if decision.unmeetable else 0)
        if decision.unmeetable:
            self.unmeetable_total.labels(pool).inc()
        if load is not None:
            self.rate.labels(pool).set(load.rate)
            self.prompt_tokens.labels(pool).set(load.mean_prompt_tokens)
        p = decision.prediction
        if p is None:
            return
        for gauge, value in ((self.ttft, p.ttft_p50_s), (self.ttft_attainment, p.ttft_attainment),
                             (self.itl, p.itl_s), (self.itl_quantile, p.itl_quantile_s)):
            if value is not None:
                gauge.labels(pool).set(value)

    def count_worker_seconds(self, source: Callable[[], dict[str, float] | None]) -> None:
        """dynamo_pd_planner_worker_seconds_total from the connector's running totals, read at each scrape:
        set once an interval, a reader integrating it over a window was up to an interval short."""
        self.registry.register(_WorkerSeconds(source))


class _WorkerSeconds(Collector):
    def __init__(self, source: Callable[[], dict[str, float] | None]) -> None:
        self._source, self._totals = source, {}

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(_P + "worker_seconds", "Seconds the pool's workers existed", labels=["pool"])
        for pool, total in (self._source() or {}).items():
            self._totals[pool] = max(total, self._totals.get(pool, 0.0))  # a counter never goes back
            family.add_metric([pool], self._totals[pool])
        yield family
