"""Tracing: one OpenTelemetry trace per request, from the frontend across every worker it reaches.

    tracing.add_args(parser)                              # --otlp-endpoint, --trace-sample-ratio
    config = tracing.config_from_args(parser, args)
    tracing.setup(config, "dynamo-pd-frontend")           # once per process; nothing when off
    span = tracing.request_span(http_headers, {...})      # frontend: a root, or the client's span's child
    child = tracing.start("route", tracing.under(span))   # a child; NOOP when `span` records nothing
    tracing.carrier(child)                                # {"traceparent": ...}: what an RPC carries
    span = tracing.start("decode", tracing.extract(context.metadata))   # worker: the caller's span's child
    tracing.end(span, error=...)                          # once or again: the first one counts

Off by default, and free when off: nothing of OpenTelemetry is imported until `setup` runs with an endpoint;
until then every call here returns NOOP / None / {} at once. Traces start only at the frontend (a request
span, sampled at the ratio unless the client's traceparent decided already); everything after it is a
child of a context that was propagated to it, so an unsampled request carries nothing to the workers and
costs them nothing. W3C Trace Context is the wire format (the `traceparent` and `tracestate` headers),
which vLLM's `trace_headers` and SGLang's `external_trace_header` read too.

Spans are exported over OTLP/HTTP (protobuf) in batches, off the event loop (the SDK's exporter thread),
by this module's own TracerProvider: an engine in the same process that installs the global one (vLLM
does) does not take ours over. OTEL_EXPORTER_OTLP_HEADERS (e.g. a collector's token) applies as usual.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

EXTRA_HINT = "pip install 'dynamo-pd[tracing]' (opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http)"
_MODULES = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")
_EXPORT_TIMEOUT_S = 5.0  # a collector that does not answer: the batch is dropped, serving goes on


@dataclass(frozen=True)
class TracingConfig:
    endpoint: str = ""  # the OTLP/HTTP collector, e.g. http://127.0.0.1:4318 ("": tracing off)
    sample_ratio: float = 1.0  # of the traces the frontend starts (a client's sampled traceparent: always)

    @property
    def traces_url(self) -> str:
        """Where spans are POSTed: the endpoint's /v1/traces unless it names a path itself."""
        base = self.endpoint.rstrip("/")
        return base if base.split("://", 1)[-1].count("/") else base + "/v1/traces"


class _NoopSpan:
    """What every call returns when a span is not recorded: tracing off, or its trace not sampled."""

    __slots__ = ()

    def is_recording(self) -> bool:
        return False

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        pass

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        pass


NOOP = _NoopSpan()
_tracer: Any = None  # the SDK's Tracer once setup() ran with an endpoint
_provider: Any = None
_w3c: Any = None  # the W3C Trace Context propagator
_config = TracingConfig()


def enabled() -> bool:
    return _tracer is not None


def config() -> TracingConfig:
    """This process's tracing (engines that trace themselves export to the same endpoint)."""
    return _config


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("tracing")
    g.add_argument("--otlp-endpoint", default="", metavar="URL",
                   help="export OpenTelemetry traces over OTLP/HTTP to this collector, e.g. "
                        f"http://127.0.0.1:4318 (default: no tracing; needs {EXTRA_HINT.split(' (')[0]})")
    g.add_argument("--trace-sample-ratio", type=float, default=TracingConfig.sample_ratio,
                   help="the fraction of requests traced (a client's sampled traceparent is always "
                        "continued; default %(default)s)")


def config_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> TracingConfig:
    """The flags checked, before anything starts: a bad ratio or URL, or the packages missing, is one line."""
    if not 0 <= args.trace_sample_ratio <= 1:
        parser.error(f"--trace-sample-ratio must be in [0, 1], got {args.trace_sample_ratio}")
    endpoint = args.otlp_endpoint
    if endpoint:
        if not endpoint.startswith(("http://", "https://")):
            parser.error(f"--otlp-endpoint must be an OTLP/HTTP URL (http://HOST:4318), got {endpoint!r}")
        try:
            missing = [m for m in _MODULES if importlib.util.find_spec(m) is None]
        except ModuleNotFoundError:  # the opentelemetry namespace itself is absent
            missing = list(_MODULES)
        if missing:
            parser.error(f"--otlp-endpoint needs OpenTelemetry, which is not installed: {EXTRA_HINT}")
    return TracingConfig(endpoint, args.trace_sample_ratio)


def argv(config: TracingConfig) -> list[str]:
    """`config` as the flags a child process takes (serve passes them to the frontend and every worker)."""
    if not config.endpoint:
        return []
    return ["--otlp-endpoint", config.endpoint, "--trace-sample-ratio", f"{config.sample_ratio:g}"]


def setup(config: TracingConfig, service: str, instance: str = "") -> None:
    """Start exporting this process's spans as `service` (its `instance` beside); nothing when off."""
    global _tracer, _provider, _w3c, _config
    if not config.endpoint or _tracer is not None:
        return
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    resource = Resource.create({"service.name": service,
                                "service.instance.id": instance or f"{service}-{os.getpid()}"})
    _provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)), resource=resource)
    exporter = OTLPSpanExporter(config.traces_url, timeout=_EXPORT_TIMEOUT_S)
    _provider.add_span_processor(BatchSpanProcessor(exporter))
    _tracer, _w3c, _config = _provider.get_tracer("dynamo_pd"), TraceContextTextMapPropagator(), config


def shutdown() -> None:
    """Export what is still queued and stop (a process's last step; safe when off)."""
    global _tracer, _provider, _config
    if _provider is not None:
        _provider.shutdown()
    _tracer, _provider, _config = None, None, TracingConfig()


def request_span(headers: Mapping[str, str], attributes: Mapping[str, Any] | None = None,
                 start_ns: int | None = None) -> Any:
    """The frontend's span of one HTTP request: a child of the client's `traceparent` when it sent one,
    else a new trace, sampled at the ratio, with the client's X-Request-ID (OpenTelemetry's
    `http.request.header.<name>`) when it sent one; it starts at `start_ns` (the request's arrival) when
    given. NOOP when off or not sampled."""
    if _tracer is None:
        return NOOP
    from opentelemetry.trace import SpanKind

    parent = _w3c.extract(headers) if "traceparent" in headers else None
    span = _tracer.start_span("request", parent, SpanKind.SERVER, attributes, start_time=start_ns)
    if not span.is_recording():
        return NOOP
    if (client_id := headers.get("x-request-id")) is not None:  # the client's own id finds its trace
        span.set_attribute("http.request.header.x-request-id", [client_id])
    return span


def start(name: str, parent: Any, attributes: Mapping[str, Any] | None = None,
          start_ns: int | None = None) -> Any:
    """A span under `parent` (from `under` or `extract`); NOOP when `parent` is None."""
    if parent is None or _tracer is None:
        return NOOP
    return _tracer.start_span(name, parent, attributes=attributes, start_time=start_ns)


def under(span: Any) -> Any:
    """The context whose spans are `span`'s children; None when `span` is not recorded."""
    if span is NOOP:
        return None
    from opentelemetry import trace

    return trace.set_span_in_context(span)


def carrier(span: Any) -> dict[str, str]:
    """`span`'s W3C headers ({} when it is not recorded): a child anywhere continues its trace."""
    if span is NOOP:
        return {}
    headers: dict[str, str] = {}
    _w3c.inject(headers, under(span))
    return headers


def extract(headers: Mapping[str, str]) -> Any:
    """The context that `carrier` wrote, for `start`; None when off or there is none."""
    if _tracer is None or not headers:
        return None
    return _w3c.extract(headers)


def end(span: Any, error: BaseException | str | None = None, end_ns: int | None = None) -> None:
    """End `span` (again is nothing); an `error` marks it failed."""
    if span is NOOP or not span.is_recording():
        return
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, str(error) or type(error).__name__))
        if isinstance(error, BaseException):
            span.set_attribute("error.type", type(error).__name__)
    span.end(end_ns)


def now_ns() -> int:
    """The clock spans are stamped with (wall time, ns): for a span recorded after the fact."""
    return time.time_ns()
