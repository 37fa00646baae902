"""Reading aiperf's exports and the arithmetic on them, against values computed by hand.

data/ holds a real aiperf 0.13.0 export (6 requests, 1500 input / 12 output tokens, 3 at a time, on one
mocker worker, run with --goodput 'time_to_first_token:250 inter_token_latency:15'), trimmed to the fields
read here. Its six requests (TTFT ms, inter_token_latency ms, request_latency ms, cached tokens):
  r1 122.405545 12.990000 265.295546  0    r4  81.466680 13.855986 233.882523 16
  r2 166.827974  9.678073 273.286774  0    r5 110.326405  9.698363 217.008401 16
  r3 171.032616  9.185289 272.070796 16    r6 138.094527  8.141992 227.656434 16
"""

from pathlib import Path

import pytest

from benchmarks import aiperf_run, report
from benchmarks.aiperf_run import Record, Slo

DATA = Path(__file__).parent / "data"
# first request start r1 ...303114397084 ns; last response end r6 ...303415174744 + 227656434 = ...303642831178 ns
DURATION_S = 0.528434094


def test_parse_records():
    records = aiperf_run.parse_records(DATA / "profile_export.jsonl")
    assert len(records) == 6 and all(r.error is None for r in records)
    r1 = records[0]
    assert (r1.ttft_ms, r1.itl_ms, r1.latency_ms) == pytest.approx((122.405545, 12.990000090909092, 265.295546))
    assert (r1.output_tokens, r1.prompt_tokens, r1.cached_tokens) == (12, 1530, 0)
    assert len(r1.chunk_gaps_ms) == 11 and r1.chunk_gaps_ms[0] == pytest.approx(46.81888)


def test_duration_is_first_start_to_last_response():
    result = aiperf_run.read(DATA)
    assert result.duration_s == pytest.approx(DURATION_S, rel=1e-9)
    assert result.duration_s == pytest.approx(0.52843392, rel=1e-5)  # aiperf's benchmark_duration


def test_goodput_by_hand():
    records = aiperf_run.parse_records(DATA / "profile_export.jsonl")
    # TTFT <= 170 and TPOT <= 10: r2 (166.8, 9.68), r5 (110.3, 9.70), r6 (138.1, 8.14); r1 and r4 miss the
    # TPOT bound, r3 the TTFT bound (171.03)
    slo = Slo(ttft_ms=170, itl_ms=10)
    assert [report.is_good(r, slo) for r in records] == [False, True, False, False, True, True]
    assert report.goodput(records, slo, DURATION_S) == pytest.approx(3 / DURATION_S)  # 5.6772 req/s


def test_goodput_matches_aiperf():
    """The run's own bounds: our good requests are aiperf's; aiperf's goodput divides them by its
    profiling phase window (start_time..end_time: 0.541273 s), ours by the benchmark duration."""
    result = aiperf_run.read(DATA)
    s = report.summarize("c", "g", None, result, Slo(ttft_ms=250, itl_ms=15))
    assert s.good == result.aiperf_good == 6
    assert s.goodput == pytest.approx(6 / DURATION_S)
    assert result.aiperf_goodput == pytest.approx(6 / 0.541273, rel=1e-5)


def test_summary_percentiles_and_hit_rate():
    s = report.summarize("c", "g", None, aiperf_run.read(DATA), Slo(250, 15))
    # sorted TTFTs 81.46668 110.326405 122.405545 138.094527 166.827974 171.032616; numpy's linear rule:
    # p50 = (122.405545 + 138.094527) / 2, p90 = 166.827974 + 0.5 * (171.032616 - 166.827974),
    # p99 = 166.827974 + 0.95 * (171.032616 - 166.827974): the p50/p90/p99 aiperf reports for this run
    assert s.ttft_ms == pytest.approx({50: 130.250036, 90: 168.930295, 99: 170.8223839})
    assert s.kv_hit_rate == pytest.approx(64 / (6 * 1530))
    assert s.output_tok_s == pytest.approx(72 / DURATION_S)
    assert (s.ok, s.failed) == (6, 0)


def test_speedup_scales_times_and_rates():
    """Mocker at --speedup 2: simulated times are twice the measured ones, rates half."""
    plain, fast = aiperf_run.read(DATA), aiperf_run.read(DATA, speedup=2.0)
    assert fast.records[0].ttft_ms == pytest.approx(2 * plain.records[0].ttft_ms)
    assert fast.records[0].chunk_gaps_ms[0] == pytest.approx(2 * plain.records[0].chunk_gaps_ms[0])
    assert fast.duration_s == pytest.approx(2 * plain.duration_s)
    assert fast.aiperf_goodput == pytest.approx(plain.aiperf_goodput / 2)
    # the bounds are simulated too: TTFT <= 340 simulated ms is TTFT <= 170 measured
    assert report.goodput(fast.records, Slo(340, 20), fast.duration_s) == pytest.approx(3 / (2 * DURATION_S))


def test_failed_or_single_token_requests_are_never_good():
    slo = Slo(1000, 1000)
    failed = Record(start_ns=0, latency_ms=5, ttft_ms=None, itl_ms=None, error="503 no workers")
    one_token = Record(start_ns=0, latency_ms=5, ttft_ms=5, itl_ms=None, output_tokens=1)
    good = Record(start_ns=0, latency_ms=5, ttft_ms=5, itl_ms=1, output_tokens=2)
    assert [report.is_good(r, slo) for r in (failed, one_token, good)] == [False, False, True]
    # the failed request is not in the duration either
    assert aiperf_run.duration_s([failed, good]) == pytest.approx(0.005)


def test_aiperf_command_scales_load_and_bounds(tmp_path):
    workload = aiperf_run.Workload("w", ["--synthetic-input-tokens-mean", "10"], requests=7, rate=8.0)
    cmd = aiperf_run.command("aiperf", "http://h", "m", "tok", workload, Slo(300, 12), 0.25, 5, tmp_path, 60)
    arg = lambda flag: cmd[cmd.index(flag) + 1]  # noqa: E731
    assert arg("--request-rate") == "2"  # 8 simulated req/s at a quarter of real speed
    assert arg("--goodput") == "time_to_first_token:1200 inter_token_latency:48"
    assert (arg("--request-count"), arg("--random-seed"), arg("--benchmark-duration")) == ("7", "5", "60")


def test_crossover():
    from benchmarks.agg_vs_disagg import crossover

    def s(config, x, goodput):
        return report.Summary(config, f"{x}", x, 1, 0, {}, {}, {}, {}, 0, 0, goodput, 0, None, None, 0)

    # disaggregation ahead at 1 (noise), level at 2, ahead from 3 on
    runs = [s("agg", 1, 5), s("dis", 1, 6), s("agg", 2, 6), s("dis", 2, 6), s("agg", 3, 5), s("dis", 3, 7),
            s("agg", 4, 4), s("dis", 4, 8)]
    assert crossover(runs, "agg", "dis") == 3
    assert crossover(runs[:4], "agg", "dis") is None


def test_missing_aiperf_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("DYNAMO_PD_AIPERF", str(tmp_path / "nowhere"))
    with pytest.raises(SystemExit, match=r"pip install aiperf==0\.13\.0"):
        aiperf_run.find_aiperf()
