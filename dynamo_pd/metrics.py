"""Prometheus metrics of one frontend: latency, load, KV reuse, hand-off transfers, fallbacks."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
        self._prompt_total = self._cached_total = 0  # for the hit rate (counters expose no public read)
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "dynamo_pd_requests", "Finished HTTP generation requests", ["route", "status"], registry=r
        )
        self.inflight = Gauge("dynamo_pd_inflight_requests", "Requests being served", registry=r)
        self.queued = Gauge("dynamo_pd_queued_requests", "Requests waiting for their first token", registry=r)
        self.ttft = Histogram("dynamo_pd_ttft_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("dynamo_pd_itl_seconds", "Inter-token latency", buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("dynamo_pd_prompt_tokens", "Prompt tokens served", registry=r)
        self.cached_tokens = Counter(
            "dynamo_pd_cached_prompt_tokens", "Prompt tokens served from a KV cache", registry=r
        )
        self.completion_tokens = Counter("dynamo_pd_completion_tokens", "Generated tokens", registry=r)
        self.kv_hit_rate = Gauge(
            "dynamo_pd_kv_hit_rate", "Cached prompt tokens / prompt tokens, since start", registry=r
        )
        self.transfer_bytes = Counter("dynamo_pd_kv_transfer_bytes", "KV bytes moved prefill -> decode", registry=r)
        self.transfer_seconds = Histogram(
            "dynamo_pd_kv_transfer_seconds", "Time to move one request's KV", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.worker_free_blocks = Gauge("dynamo_pd_worker_free_blocks", "KV blocks no request holds", ["worker"],
                                        registry=r)
        self.worker_total_blocks = Gauge("dynamo_pd_worker_total_blocks", "KV blocks of the worker", ["worker"],
                                         registry=r)
        self.worker_running = Gauge("dynamo_pd_worker_running_requests", "Requests running on the worker",
                                    ["worker"], registry=r)
        self.indexed_blocks = Gauge("dynamo_pd_router_indexed_blocks", "KV blocks the router's indexer holds",
                                    ["worker"], registry=r)
        self.replica_updates = Gauge("dynamo_pd_router_replica_updates",
                                     "Load updates applied from other frontends' routers, since start", registry=r)
        self.replica_expired = Gauge("dynamo_pd_router_replica_expired",
                                     "Other frontends' placements dropped because their finish never came",
                                     registry=r)
        self.rpc_connections = Gauge("dynamo_pd_rpc_connections", "Open request-plane connections to workers",
                                     registry=r)
        self.fallbacks = Counter(
            "dynamo_pd_prefill_fallbacks",
            "Remote prefills or transfers that failed and fell back",
            ["reason"],
            registry=r,
        )
        for reason in ("prefill_failed", "transfer_failed"):  # rendered as 0 from the start: none is a count
            self.fallbacks.labels(reason)
        self.migrations = Counter(
            "dynamo_pd_migrations",
            "Requests moved to another worker after the client had "
            "tokens, by the failure (worker_gone, stalled, draining, ...)",
            ["reason"],
            registry=r,
        )
        self.migration_kv = Counter("dynamo_pd_migration_kv", "Migrated requests by where their context's KV came "
                                    "from: moved (read from a peer: the drained worker, or one holding it), "
                                    "local (the new worker's pool or tiers), recomputed", ["kv"], registry=r)
        for kv in ("moved", "local", "recomputed"):
            self.migration_kv.labels(kv)
        self.retries = Counter("dynamo_pd_retries", "Requests retried on another worker before their first token, "
                               "by the failure", ["reason"], registry=r)
        self.workers_refused = Counter("dynamo_pd_workers_refused", "Workers registered that the frontend cannot "
                                       "serve (model, KV block size)", ["reason"], registry=r)
        self.unknown_fields = Counter("dynamo_pd_request_fields_unknown", "Request fields no OpenAI or vLLM schema "
                                      "this server knows: accepted and ignored (dynamo_pd/frontend/fields.py)",
                                      ["route", "field"], registry=r)

    def record_usage(self, prompt: int, cached: int, completion: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.cached_tokens.inc(cached)
        self.completion_tokens.inc(completion)
        self._prompt_total += prompt
        self._cached_total += cached
        self.kv_hit_rate.set(self._cached_total / self._prompt_total if self._prompt_total else 0.0)

    def record_load(self, worker: str, running: int, free_blocks: int, total_blocks: int) -> None:
        self.worker_running.labels(worker).set(running)
        self.worker_free_blocks.labels(worker).set(free_blocks)
        self.worker_total_blocks.labels(worker).set(total_blocks)

    def forget_worker(self, worker: str) -> None:
        for gauge in (self.worker_running, self.worker_free_blocks, self.worker_total_blocks, self.indexed_blocks):
            try:
                gauge.remove(worker)
            except KeyError:
                pass

    def render(self) -> bytes:
        return generate_latest(self.registry)
