"""benchmarks/planner_dynamo.py's own arithmetic (which trace rows, how a Dynamo replay record becomes our
TTFT/ITL, attainment, goodput, peak and average) on tiny inputs. Dynamo's replay itself is not run here: it
lives in .venv-dynamo, which CI does not make, and a skip fails the run; the benchmark's committed results are
its run."""

import argparse
import json

import pytest

from benchmarks import planner, router_policies, sinusoid
from benchmarks import planner_dynamo as pd


def test_the_trace_rules_are_router_policies_own():
    assert pd.CONTEXT_TOKENS == router_policies.CONTEXT_TOKENS
    assert pd.TRACE_BLOCK_TOKENS == router_policies.TRACE_BLOCK_TOKENS
    assert pd.TRACE == router_policies.TRACE


def test_trace_rows_keep_the_first_that_fit_at_their_own_timestamps(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [{"timestamp": 0, "input_length": 8000, "output_length": 100, "hash_ids": [1]},  # fits 8192 - 64
            {"timestamp": 5, "input_length": 8100, "output_length": 100, "hash_ids": [2]},  # too long
            {"timestamp": 9, "input_length": 100, "output_length": 0, "hash_ids": [3]},
            {"timestamp": 12, "input_length": 200, "output_length": 7, "hash_ids": [4]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kept = pd.trace_rows(path, 2)
    assert [r["timestamp"] for r in kept] == [0, 9]  # simulated ms, not divided by any speedup
    assert kept[1]["output_length"] == 1  # router_policies' max(1, ...)
    assert len(pd.trace_rows(path, None)) == 3
    with pytest.raises(SystemExit):
        pd.trace_rows(path, 4)


def test_the_real_trace_gives_100_rows_as_our_benchmark_replays():
    rows = pd.trace_rows(pd.TRACE, pd.TRACE_REQUESTS)
    assert len(rows) == 100
    assert all(r["input_length"] + r["output_length"] <= pd.CONTEXT_TOKENS - pd.TEMPLATE_TOKENS for r in rows)


def test_the_sinusoid_is_the_one_our_benchmark_replays_with_quick_and_2_periods():
    ours = planner.parse_args(["--quick", "--periods", "2"])
    assert pd.SINUSOID == {k: getattr(ours, k) for k in ("low", "high", "period_s", "periods", "isl", "osl", "seed")}
    mine = pd.parse_args([])
    assert mine.workloads == ["sinusoid", "mooncake"]
    assert {k: getattr(mine, k) for k in pd.SINUSOID} == pd.SINUSOID
    assert pd.parse_args(["--workloads", "sinusoid"]).workloads == ["sinusoid"]
    with pytest.raises(SystemExit):
        pd.parse_args(["--workloads", "square"])


def test_the_sinusoid_rows_are_what_benchmarks_planner_replays(tmp_path):
    small = dict(low=1.0, high=6.0, period_s=10.0, periods=2, isl=1100, osl=20, seed=3)
    for name in "bc":
        (tmp_path / name).mkdir()
    rows = pd.sinusoid_rows(**small)
    times = sinusoid.times(small["low"], small["high"], small["period_s"], small["periods"], small["seed"])
    path, count = planner.sinusoid_file(tmp_path / "b", argparse.Namespace(**small), 1.0)
    theirs = [json.loads(line) for line in path.read_text().splitlines()]
    assert 20 < len(rows) == count == len(times) == len(theirs)  # 2 periods at 3.5 req/s on average: ~70
    assert rows == theirs  # timestamps, lengths and hash blocks alike
    assert [r["timestamp"] for r in rows] == [round(t * 1e3) for t in times]  # simulated ms
    assert all(r["input_length"] == 1100 and r["output_length"] == 20 for r in rows)
    assert len({r["hash_ids"][0] for r in rows}) == len(rows)  # every first block its own: no shared prefix
    assert all(len(r["hash_ids"]) == 3 for r in rows)  # 1100 tokens in 512-token blocks
    # our benchmark's file at its --speedup 0.25 holds real ms: the same arrivals, to the rounding
    path, _ = planner.sinusoid_file(tmp_path / "c", argparse.Namespace(**small), 0.25)
    real = [json.loads(line)["timestamp"] for line in path.read_text().splitlines()]
    assert len(real) == len(rows)
    assert all(abs(ms * 0.25 - r["timestamp"]) <= 0.5 for ms, r in zip(real, rows))
    assert pd.sinusoid_rows(**{**small, "seed": 4}) != rows


def test_a_record_becomes_ttft_and_aiperfs_per_request_itl():
    record = {"arrival_time_ms": 1000.0, "first_token_ms": 1200.0, "last_token_ms": 1240.0, "output_length": 5,
              "requested_output_length": 5}
    o = pd.outcome(record)
    assert o.ttft_ms == pytest.approx(200.0) and o.itl_ms == pytest.approx(10.0) and o.end_ms == 1240.0
    single = pd.outcome({**record, "last_token_ms": 1200.0, "output_length": 1, "requested_output_length": 1})
    assert single.itl_ms is None and not pd.is_good(single, pd.Slo(1e9, 1e9))  # no ITL: not good
    unfinished = pd.outcome({**record, "last_token_ms": None, "output_length": 2})
    assert unfinished.end_ms is None


def test_attainment_goodput_and_worker_seconds():
    slo = pd.Slo(250.0, 8.0)
    outcomes = [pd.Outcome(0.0, 2000.0, 100.0, 7.0),  # good
                pd.Outcome(500.0, 3000.0, 300.0, 7.0),  # TTFT over
                pd.Outcome(1000.0, 4000.0, 100.0, 9.0),  # ITL over
                pd.Outcome(1500.0, None, None, None)]  # failed
    run = pd.make_run("t", "static", 2, 3, outcomes, slo)
    assert (run.requests, run.failed, run.good) == (4, 1, 1)
    assert run.duration_s == pytest.approx(4.0)  # first arrival to last token
    assert run.worker_seconds == pytest.approx(20.0)  # 5 workers x 4 s
    assert run.attainment == pytest.approx(0.25) and run.goodput == pytest.approx(0.25)
    assert run.goodput_per_worker_s == pytest.approx(0.05)
    planner = pd.make_run("t", "planner", 1.5, 1.0, outcomes, slo, worker_seconds=10.0)
    assert planner.goodput_per_worker_s == pytest.approx(0.1)
    peak = pd.make_run("t", "static peak", 2, 3, outcomes, slo)
    runs = [planner, peak]
    pd.rate_vs_peak(runs)
    assert planner.vs_peak == pytest.approx(2.0) and peak.vs_peak == pytest.approx(1.0)
    assert "2.00x" in pd.table_md(runs)


def test_planner_targets_peak_and_average_split():
    ticks = [{"effects": {"scale_to": None}}, {"effects": {"scale_to": {"num_prefill": 3, "num_decode": None}}},
             {"effects": {"scale_to": {"num_prefill": None, "num_decode": 4}}},
             {"effects": {"scale_to": {"num_prefill": 1, "num_decode": 2}}}]
    targets = pd.planner_targets(ticks)
    assert targets == [(1, 1), (3, 1), (3, 4), (1, 2)]
    assert pd.peak(targets) == (3, 4)
    assert pd.peak([]) == (1, 1)
    assert pd.average_splits(1.62, 2.19) == [(1, 3), (2, 2)]  # as benchmarks/planner.py split its 1.62P 2.19D
    assert pd.average_splits(1.0, 1.0) == [(1, 1)]
