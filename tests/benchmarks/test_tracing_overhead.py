"""benchmarks/tracing_overhead.py's reading of traces against aiperf's records, and its flags. The spans and
the X-Request-ID attribute it reads come from the real frontend in tests/test_tracing.py."""

import pytest

from benchmarks.aiperf_run import Record
from benchmarks.otlp_receiver import Span
from benchmarks.tracing_overhead import parse_args, trace_vs_client


def span(name: str, trace: str, span_id: str, parent: str, start_ms: float, end_ms: float, **attributes) -> Span:
    return Span(trace, span_id, parent, name, "dynamo-pd-frontend", int(start_ms * 1e6), int(end_ms * 1e6),
                attributes, [], 0)


def record(request_id: str, ttft_ms: float, connect_ms: float = 0.0) -> Record:
    return Record(start_ns=0, latency_ms=500.0, ttft_ms=ttft_ms, itl_ms=8.0, request_id=request_id,
                  connect_ms=connect_ms)


def test_each_request_is_matched_by_its_x_request_id_to_its_first_tokens_end():
    spans = [span("request", "t1", "r1", "", 1000, 1600, **{"http.request.header.x-request-id": ["a"]}),
             span("first_token", "t1", "f1", "r1", 1090, 1100),  # sent 100 ms after arrival
             span("request", "t2", "r2", "", 2000, 2600, **{"http.request.header.x-request-id": ["b"]}),
             span("first_token", "t2", "f2", "r2", 2150, 2160),
             span("first_token", "t9", "f9", "r9", 0, 1),  # another request's: not matched to either
             span("request", "t3", "r3", "", 3000, 3600)]  # a client that sent no id
    records = [record("a", 104.0, connect_ms=4.0), record("b", 200.0), record("untraced", 90.0)]
    found = trace_vs_client(records, spans)
    assert found["requests"] == 3 and found["matched"] == 2
    assert found["median_error"] == pytest.approx(((100 / 104 - 1) + (160 / 200 - 1)) / 2)
    assert found["worst_error"] == pytest.approx(160 / 200 - 1)
    assert found["within_5pct"] == 0.5  # a within 4%, b 20% short
    assert found["median_error_sent"] == pytest.approx(((100 / 100 - 1) + (160 / 200 - 1)) / 2)
    assert found["within_5pct_sent"] == 0.5


def test_no_trace_found_is_said_not_divided_by():
    assert trace_vs_client([record("a", 100.0)], []) == {"requests": 1, "matched": 0}


@pytest.mark.parametrize("argv, message", [(["--ratio", "1"], "--ratio must be in (0, 1)"),
                                           (["--ratio", "0"], "--ratio must be in (0, 1)"),
                                           (["--rounds", "0"], "--rounds and --requests must be at least 1")])
def test_bad_flags_are_one_line_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_quick_halves_the_requests_and_rounds():
    assert (parse_args([]).requests, parse_args([]).rounds) == (120, 3)
    assert (parse_args(["--quick"]).requests, parse_args(["--quick"]).rounds) == (60, 2)
