"""benchmarks/planner.py's own arithmetic: the sinusoid's arrivals, the trace file it replays, what it reads
of the planner's intervals, and its flags. The planner itself runs end to end in tests/planner/test_e2e.py."""

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks.aiperf_run import Record, Slo
from benchmarks import deploy
from benchmarks.planner import (intervals, model_on, parse_args, peak_counts, planner_url, prediction_md,
                                sinusoid_file)
from benchmarks.sinusoid import times as sinusoid_times


def test_sinusoid_arrivals_follow_the_rate_from_low_to_high_and_back():
    times = sinusoid_times(low=2.0, high=20.0, period_s=100.0, periods=4, seed=0)
    assert times == sorted(times) and 0 <= times[0] and times[-1] < 400
    # the expected count is the rate's integral: the mean rate (11 req/s) over 400 s
    assert len(times) == pytest.approx(11 * 400, rel=0.05)
    phase = np.array(times) % 100.0
    trough = np.sum((phase < 10) | (phase >= 90))  # around t = 0 mod 100: the rate near its low
    peak = np.sum((phase >= 40) & (phase < 60))  # around t = 50: near its high
    assert peak > 5 * trough, (peak, trough)
    assert sinusoid_times(2.0, 20.0, 100.0, 4, seed=0) == times  # one seed, one schedule


def test_the_trace_file_gives_every_prompt_its_own_first_block_in_real_milliseconds(tmp_path):
    args = SimpleNamespace(isl=1100, osl=50, low=1.0, high=8.0, period_s=20.0, periods=1, seed=3)
    path, n = sinusoid_file(tmp_path, args, speedup=0.5)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == n > 0
    assert all(r["input_length"] == 1100 and r["output_length"] == 50 for r in rows)
    assert all(len(r["hash_ids"]) == math.ceil(1100 / 512) for r in rows)
    assert len({r["hash_ids"][0] for r in rows}) == n  # no two prompts share a cached prefix
    # aiperf builds each block once, at one size: 1,100 = 2 x 512 + 76, so each prompt's last block is its own
    lasts = [r["hash_ids"][-1] for r in rows]
    assert len(set(lasts)) == n and not set(lasts) & {h for r in rows for h in r["hash_ids"][:-1]}
    simulated = sinusoid_times(1.0, 8.0, 20.0, 1, 3)
    assert [r["timestamp"] for r in rows] == [round(t * 1e3 / 0.5) for t in simulated]  # half speed: twice as long


def _record(start_s: float, ttft_ms: float, itl_ms: float = 5.0, error: str | None = None) -> Record:
    return Record(start_ns=int(start_s * 1e9), latency_ms=ttft_ms + 100 * itl_ms, ttft_ms=ttft_ms, itl_ms=itl_ms,
                  error=error)


def test_each_interval_compares_its_prediction_with_the_requests_arriving_until_the_next_decision():
    decisions = [{"time": t, "pool": pool, "target": target, "prediction": prediction}
                 for t, pool, target, prediction in [
                     (100.0, "prefill", 1, {"ttft_p50_s": 0.2}), (100.0, "decode", 2, None),
                     (110.0, "prefill", 2, {"ttft_p50_s": 0.4}), (120.0, "prefill", 2, None)]]
    records = [_record(101, 100), _record(102, 300), _record(105, 200), _record(111, 500),
               _record(112, 9999, error="boom"), _record(121, 50)]
    rows = intervals(decisions, records, speedup=0.5, slo=Slo(ttft_ms=250, itl_ms=8))
    assert [(r["requests"], r["target"], r["measured_ttft_p50_ms"], r["good"]) for r in rows] == [
        (3, 1, 200.0, 2), (1, 2, 500.0, 0)]
    # predicted seconds of real time, reported in simulated ms (x speedup)
    assert [r["predicted_ttft_ms"] for r in rows] == [100.0, 200.0]


def test_the_static_peak_is_the_planners_largest_deployment_not_each_pools_most():
    # prefill peaked at 4 beside 9 decode workers, decode at 12 beside 3 prefill: 3P12D, not 4P12D (16 > 15)
    pools = {"prefill": [1, 2, 4, 3, 2], "decode": [1, 5, 9, 12, 6]}
    assert peak_counts(pools) == {"prefill": 3, "decode": 12}


def test_prediction_accuracy_skips_the_warm_up_and_thin_intervals():
    rows = [{"predicted_ttft_ms": p, "measured_ttft_p50_ms": m, "requests": n}
            for p, m, n in [(1, 100, 9), (1, 100, 9),  # the warm-up: not judged
                            (110, 100, 9), (60, 100, 9), (100, 100, 2), (None, 100, 9)]]
    steady = [100.0] * 50  # every request alike: any nine of them have the run's median
    text, within = prediction_md(rows, steady)
    assert within == 0.5 and "2 intervals" in text and "-40%" in text and "within 25% in 100% of them" in text
    # a long-tailed run: the median of nine requests often lands more than 25% from the median of all
    text, _ = prediction_md(rows, [10 * 1.1 ** i for i in range(60)])  # 10 ms to 3 s, evenly on a log scale
    assert "within 25% in 100% of them" not in text
    chance = int(text.split("within 25% in ")[1].split("%")[0])
    assert 5 < chance < 50
    assert prediction_md(rows[:2], steady) == ("no interval after the warm-up had both a prediction and 5 requests",
                                               None)


@pytest.mark.parametrize("argv, message", [(["--workloads", "sine"], "--workloads: unknown sine"),
                                           (["--low", "5", "--high", "2"], "need 0 < --low < --high"),
                                           (["--engine", "native"], "runs mocker workers")])
def test_bad_flags_are_one_line_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_metrics_urls_come_from_serves_lines_once_what_is_wanted_is_there(tmp_path):
    log = tmp_path / "serve.log"
    log.write_text("dynamo-pd: 2/2 workers registered\n"
                   "dynamo-pd metrics: frontend at http://127.0.0.1:1/metrics\n"
                   "dynamo-pd metrics: prefill-0 at http://127.0.0.1:2/metrics\n"
                   "dynamo-pd metrics: decode-0, decode-1 at http://127.0.0.1:3/metrics\n")
    assert deploy.worker_metrics_urls(log, 3) == ["http://127.0.0.1:2/metrics", "http://127.0.0.1:3/metrics"]
    with pytest.raises(SystemExit, match="did not name the /metrics URLs"):
        deploy.metrics_urls(log, lambda found: ["planner"] in found.values(), timeout_s=0.1)
    log.write_text(log.read_text() + "dynamo-pd metrics: planner at http://127.0.0.1:4/metrics\n")
    assert planner_url(log) == "http://127.0.0.1:4/metrics"
    assert deploy.worker_metrics_urls(log, 3) == ["http://127.0.0.1:2/metrics", "http://127.0.0.1:3/metrics"]


def test_the_model_is_run_again_on_the_arrivals_an_interval_had():
    decision = {"pool": "prefill", "target": 1, "interval_s": 20.0, "queued_prefill_tokens": 0,
                "forecast_rate": 1.0, "prediction": {"ttft_p50_s": 0.3},
                "offsets": {"ttft_p50": 0.01, "itl_mean": None, "itl_quantile": None},
                "costs": {"prefill_s_per_token": 25e-6, "decode_s": 0.0, "decode_s_per_block": 0.0},
                "limits": {"max_num_seqs": 64, "kv_blocks": 10_000, "block_size": 16, "chunk_tokens": 2048}}
    assert model_on(decision, [(1.0, 3000)]) == pytest.approx(3000 * 25e-6 + 0.01)  # alone: its prefill
    # three at once: 2048-token steps of 25e-6 s a token end the prompts at 4096, 6144 and 9000 tokens
    assert model_on(decision, [(1.0, 3000)] * 3) == pytest.approx(6144 * 25e-6 + 0.01)
    assert model_on({**decision, "pool": "decode"}, [(1.0, 3000)]) is None
    assert model_on({**decision, "costs": None}, [(1.0, 3000)]) is None  # a record from before the costs
