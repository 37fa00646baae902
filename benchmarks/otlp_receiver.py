"""A small OTLP/HTTP trace receiver: what an OpenTelemetry collector does with the spans we export, minus
the storage. It accepts protobuf POSTs on /v1/traces (gzip or not), decodes them with opentelemetry.proto
and keeps every span, so a test or a benchmark reads the traces exactly as they went over the wire.

    with OtlpReceiver() as receiver:            # listens on 127.0.0.1:<free port>, in a thread
        ... --otlp-endpoint receiver.endpoint ...
        receiver.wait_for(lambda spans: any(s.name == "request" for s in spans), timeout_s=30)
        receiver.traces()                       # trace id -> its spans
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass(frozen=True)
class Span:
    trace_id: str  # hex, as in a traceparent
    span_id: str
    parent_span_id: str  # "" for a root
    name: str
    service: str  # its resource's service.name
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, int]]  # (name, time ns)
    status_code: int  # 0 unset, 1 ok, 2 error
    status_message: str = ""

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind) if kind else None


def decode(body: bytes) -> list[Span]:
    """Every span of one ExportTraceServiceRequest."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                spans.append(Span(
                    trace_id=s.trace_id.hex(), span_id=s.span_id.hex(), parent_span_id=s.parent_span_id.hex(),
                    name=s.name, service=resource.get("service.name", ""), start_ns=s.start_time_unix_nano,
                    end_ns=s.end_time_unix_nano, attributes={kv.key: _value(kv.value) for kv in s.attributes},
                    events=[(e.name, e.time_unix_nano) for e in s.events], status_code=s.status.code,
                    status_message=s.status.message))
    return spans


@dataclass
class OtlpReceiver:
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free one
    spans: list[Span] = field(default_factory=list)
    posts: int = 0  # export requests received
    _changed: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                try:
                    spans = decode(body)
                except Exception:  # noqa: BLE001 - not OTLP protobuf: the exporter's error to see
                    self.send_error(400, "not an OTLP ExportTraceServiceRequest")
                    return
                with receiver._changed:
                    receiver.spans += spans
                    receiver.posts += 1
                    receiver._changed.notify_all()
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args) -> None:  # quiet: one line per export otherwise
                pass

        self._server = ThreadingHTTPServer((self.host, self.port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)

    @property
    def endpoint(self) -> str:
        """The --otlp-endpoint that exports here."""
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def wait_for(self, predicate: Callable[[list[Span]], bool], timeout_s: float) -> list[Span]:
        """The spans once `predicate` holds for them; AssertionError naming what arrived after `timeout_s`."""
        with self._changed:
            if not self._changed.wait_for(lambda: predicate(self.spans), timeout_s):
                names = sorted({(s.service, s.name) for s in self.spans})
                raise AssertionError(f"the spans received within {timeout_s}s do not hold: {names}")
            return list(self.spans)

    def traces(self) -> dict[str, list[Span]]:
        with self._changed:
            traces: dict[str, list[Span]] = {}
            for span in self.spans:
                traces.setdefault(span.trace_id, []).append(span)
            return traces
