"""The gateway's Prometheus metrics, on the frontend's registry (dynamo_pd.metrics.Metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from dynamo_pd.metrics import Metrics


class GatewayMetrics:
    def __init__(self, metrics: Metrics) -> None:
        r = metrics.registry
        self.approx_blocks = Gauge("dynamo_pd_router_approx_blocks", "KV blocks the router predicts (approximate: "
                                   "from its own placements) on workers that publish no KV events",
                                   ["model", "worker"], registry=r)
        self.rate_limited = Counter("dynamo_pd_rate_limited", "Requests refused with 429 by a rate limit",
                                    ["model", "limit"], registry=r)
        self.queue_full = Counter("dynamo_pd_queue_full", "Requests refused with 503: the model's queue was full",
                                  ["model"], registry=r)
        self.model_fallbacks = Counter("dynamo_pd_model_fallbacks", "Requests answered by a fallback model",
                                       ["model", "answered_by"], registry=r)
        self.worker_healthy = Gauge("dynamo_pd_worker_healthy", "1 while the worker passes its health checks",
                                    ["model", "worker"], registry=r)
        self.health_failures = Counter("dynamo_pd_health_check_failures", "Failed canary requests",
                                       ["model", "worker"], registry=r)
