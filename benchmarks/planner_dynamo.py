"""NVIDIA Dynamo's planner on the sinusoid and the Mooncake conversation trace, in Dynamo's own offline
replay, beside ours.

    .venv-dynamo/bin/python -m benchmarks.planner_dynamo            # both workloads, 2 timings x 2 targets
    .venv-dynamo/bin/python -m benchmarks.planner_dynamo --workloads sinusoid
    .venv-dynamo/bin/python -m benchmarks.planner_dynamo --quick    # 40 Mooncake rows, as `benchmarks.planner --quick`
    python -m benchmarks.planner_dynamo                             # from .venv: re-runs itself in .venv-dynamo

Run from the repository root. Dynamo 1.6.1 lives in .venv-dynamo (docs/benchmarks.md says how it is made);
started by any other Python this module runs itself again under --dynamo-python (default
.venv-dynamo/bin/python), bounded by --timeout-s.

What runs: `dynamo.replay.run_trace_replay` (Dynamo's mocker in simulated time, its KV router, a disaggregated
prefill + decode deployment) on the same rows our benchmark replays, per --workloads:
  sinusoid  the rows `python -m benchmarks.planner --quick --periods 2 --workloads sinusoid` replays (our
            planner's main benchmark, docs/planner.md): Poisson arrivals whose rate follows --low .. --high
            req/s (1 .. 24) over --periods (2) periods of --period-s (60 s), --isl (3000) / --osl (150) tokens,
            every prompt's first block its own, --seed 0: benchmarks.sinusoid's rows at speedup 1
            (timestamps in simulated ms); a test holds the defaults equal to benchmarks.planner's.
  mooncake  the rows `python -m benchmarks.planner --workloads mooncake` replays (the first --trace-requests
            rows that fit the 8192-token context, 512-token hash blocks, at the trace's own timestamps)
Our benchmark divides the timestamps by --speedup only because its mocker runs in real time; its figures are
simulated time, as Dynamo's replay is. Per workload, timing and planner target:
  planner         Dynamo's planner (`planner_config`, mode disagg) from 1 prefill + 1 decode worker
  static peak     the counts of the planner's target with the most workers in all, held the whole run
  static average  the planner's average worker count, split as it split it on average (rounded down and up)
Reported as benchmarks/planner.py reports ours: SLA attainment (TTFT <= 250 ms and the per-request ITL, aiperf's
(last token - first token) / (output tokens - 1), <= 8 ms; a request of 1 output token has no ITL and is not
good), goodput (good requests / the window from the first arrival to the last token), worker-seconds (static:
workers x that window; planner: Dynamo's own prefill + decode worker-seconds), goodput per worker-second and
its ratio to the static peak's, failed (requests that never completed).

Engine timing (--timing, both by default, a block of runs each): `ours` gives Dynamo's mocker our mocker's step
costs, Llama-3.1-8B bf16 on one H100 SXM (dynamo_pd.engines.mocker.profile.h100_llama8b), through the profile
format Dynamo's mocker reads (a mocker-format NPZ: prefill time by prompt length, decode ITL by active KV tokens
and context), with our mocker's limits (54 GiB of KV, 16-token blocks, 64 sequences, 2048 batched tokens) and KV
hand-off (40 GB/s, 128 KiB a token); `dynamo` keeps Dynamo's mocker defaults (its built-in polynomial timing,
16384 blocks of 64 tokens, 256 sequences, 8192 batched tokens).

Planner (--planner-target, both by default): Dynamo's default optimization_target `throughput` (load-based:
prefill queue against the context length, decode KV utilization, thresholds fixed in
dynamo.planner.core.load_scaling, every 5 s; it ignores TTFT/ITL SLOs), or `latency` (the same loop, lower
thresholds). Its SLO-driven target (`sla`) cannot run here: in 1.6.1 its performance model, the FPM regression
included, is in `aisimulate_core`, whose only PyPI release is a stub that downloads the wheel from NVIDIA's own
index, which this machine cannot reach. Dynamo's planner package imports that module at load time, so this
module registers empty stand-ins for `aisimulate`/`aisimulate_core` whose every use raises ImportError (the
load-based targets never use them). Its other imports (scikit-learn, plotly, pandas, pmdarima, filterpy,
prophet, prometheus-api-client, grpcio) must be installed in .venv-dynamo (`pip install` them by name).

Writes summaries.json and table.md into --out (benchmarks/results/planner_dynamo).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks import provenance, sinusoid
from benchmarks.aiperf_run import Slo

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "benchmarks" / "data" / "mooncake_conversation_trace.jsonl"
WORKLOADS = ("sinusoid", "mooncake")
OUT = ROOT / "benchmarks" / "results" / "planner_dynamo"
DYNAMO_PYTHON = ROOT / ".venv-dynamo" / "bin" / "python"
# benchmarks/router_policies.py's (importing it would need our whole stack); a test holds them equal
CONTEXT_TOKENS = 8192
TRACE_BLOCK_TOKENS = 512
TEMPLATE_TOKENS = 64  # router_policies leaves this much of the context to the chat template
# benchmarks/planner.py's DEFAULTS: the SLOs, budget and --quick trace rows
TTFT_SLO_MS, ITL_SLO_MS, BUDGET = 250.0, 8.0, 16
TRACE_REQUESTS, QUICK_TRACE_REQUESTS = 100, 40
# the sinusoid of `benchmarks.planner --quick --periods 2` (its DEFAULTS' low, high, quick_period_s, isl, osl;
# benchmarks.session's --seed default); a test holds them equal to what that parse_args gives
SINUSOID = dict(low=1.0, high=24.0, period_s=60.0, periods=2, isl=3000, osl=150, seed=0)
# our mocker's worker, as benchmarks.planner starts it (dynamo_pd.cli's defaults, --kv-cache-memory-gb 54)
KV_CACHE_GIB, BLOCK_TOKENS, MAX_NUM_SEQS, MAX_BATCHED_TOKENS = 54.0, 16, 64, 2048


@dataclass(frozen=True)
class Outcome:
    """One replayed request, simulated ms from its arrival."""
    arrival_ms: float
    end_ms: float | None  # its last token; None: it never completed
    ttft_ms: float | None
    itl_ms: float | None  # aiperf's per-request inter_token_latency; None below 2 output tokens


@dataclass
class Run:
    trace: str  # which block: "ours timing, throughput" (engine timing, planner target)
    config: str
    prefill: float  # workers: a static count, or the planner's average
    decode: float
    requests: int
    failed: int
    good: int
    duration_s: float  # first arrival to last token, simulated
    worker_seconds: float
    attainment: float = 0.0
    goodput: float = 0.0
    goodput_per_worker_s: float = 0.0
    vs_peak: float | None = None  # goodput per worker-second / the static peak's
    dynamo_goodput_requests: int | None = None  # Dynamo's own SLA count (goodput_completed_requests)
    peak: tuple[int, int] | None = None  # the planner's: its target with the most workers in all

    def __post_init__(self) -> None:
        self.attainment = self.good / self.requests if self.requests else 0.0
        self.goodput = self.good / self.duration_s if self.duration_s else 0.0
        self.goodput_per_worker_s = self.good / self.worker_seconds if self.worker_seconds else 0.0


def trace_rows(path: Path, rows: int | None) -> list[dict]:
    """The first `rows` rows (all when None) that fit the context, as router_policies.trace_file keeps them,
    timestamps left in the trace's own (simulated) ms."""
    kept = []
    with path.open() as f:
        for line in f:
            row = json.loads(line)
            if row["input_length"] + max(1, row["output_length"]) > CONTEXT_TOKENS - TEMPLATE_TOKENS:
                continue
            kept.append({"timestamp": row["timestamp"], "input_length": row["input_length"],
                         "output_length": max(1, row["output_length"]), "hash_ids": row["hash_ids"]})
            if len(kept) == rows:
                break
    if rows is not None and len(kept) < rows:
        raise SystemExit(f"error: {path} holds only {len(kept)} rows that fit the context, not {rows}")
    return kept


def sinusoid_rows(low: float, high: float, period_s: float, periods: int, isl: int, osl: int, seed: int
                  ) -> list[dict]:
    """The sinusoid's rows as benchmarks.planner replays them, at speedup 1: timestamps in simulated ms."""
    return sinusoid.rows(low, high, period_s, periods, isl, osl, seed, TRACE_BLOCK_TOKENS)


def outcome(record: dict) -> Outcome:
    """A Dynamo replay per-request record (report.per_request) as our benchmark measures a request."""
    arrival, first, last = record["arrival_time_ms"], record.get("first_token_ms"), record.get("last_token_ms")
    n = record.get("output_length") or 0
    done = last is not None and n >= record.get("requested_output_length", n)
    itl = (last - first) / (n - 1) if done and first is not None and n >= 2 else None
    return Outcome(arrival, last if done else None, None if first is None else first - arrival, itl)


def is_good(o: Outcome, slo: Slo) -> bool:
    """benchmarks.report.is_good: completed, and both bounds met (no ITL: not good)."""
    return (o.end_ms is not None and o.ttft_ms is not None and o.ttft_ms <= slo.ttft_ms and o.itl_ms is not None
            and o.itl_ms <= slo.itl_ms)


def window_s(outcomes: list[Outcome]) -> float:
    """From the first arrival to the last token of a completed request, simulated s."""
    ends = [o.end_ms for o in outcomes if o.end_ms is not None]
    return (max(ends) - min(o.arrival_ms for o in outcomes)) / 1e3 if ends else 0.0


def make_run(trace: str, config: str, prefill: float, decode: float, outcomes: list[Outcome], slo: Slo,
             worker_seconds: float | None = None, **extra: Any) -> Run:
    """A static deployment's worker-seconds are its workers x the window; the planner passes its own."""
    duration = window_s(outcomes)
    seconds = (prefill + decode) * duration if worker_seconds is None else worker_seconds
    return Run(trace, config, prefill, decode, len(outcomes), sum(o.end_ms is None for o in outcomes),
               sum(is_good(o, slo) for o in outcomes), duration, seconds, **extra)


def planner_targets(ticks: list[dict], start: tuple[int, int] = (1, 1)) -> list[tuple[int, int]]:
    """The (prefill, decode) target after each planner tick: a tick's effects.scale_to (Dynamo's
    ScalingDecision: num_prefill, num_decode, None for no opinion) changes what it names, every other tick
    keeps the last target."""
    prefill, decode = start
    targets = []
    for tick in ticks:
        change = (tick.get("effects") or {}).get("scale_to") or {}
        prefill = prefill if change.get("num_prefill") is None else change["num_prefill"]
        decode = decode if change.get("num_decode") is None else change["num_decode"]
        targets.append((prefill, decode))
    return targets


def peak(targets: list[tuple[int, int]], start: tuple[int, int] = (1, 1)) -> tuple[int, int]:
    """benchmarks.planner.peak_counts: the target with the most workers in all (one moment's deployment)."""
    return max([start, *targets], key=sum)


def average_splits(prefill: float, decode: float) -> list[tuple[int, int]]:
    """benchmarks.planner: the average size n (at least 2) split as the average split, rounded both ways."""
    n = max(2, round(prefill + decode))
    share = prefill / max(1e-9, prefill + decode)
    return [(p, n - p) for p in sorted({min(n - 1, max(1, f(n * share))) for f in (math.floor, math.ceil)})]


def rate_vs_peak(runs: list[Run]) -> None:
    """Each run's goodput per worker-second over the static peak's, per trace."""
    for trace in {r.trace for r in runs}:
        base = next((r for r in runs if r.trace == trace and r.config == "static peak"), None)
        for r in runs:
            if r.trace == trace and base and base.goodput_per_worker_s:
                r.vs_peak = r.goodput_per_worker_s / base.goodput_per_worker_s


def table_md(runs: list[Run]) -> str:
    head = ["trace", "config", "prefill", "decode", "requests", "failed", "SLA attainment", "goodput req/s",
            "worker-s", "goodput / worker-s", "vs static peak", "Dynamo's own SLA count"]
    lines = [f"| {' | '.join(head)} |", f"|{'---|' * len(head)}"]
    for r in runs:
        cells = [r.trace, r.config, f"{r.prefill:.2f}", f"{r.decode:.2f}", str(r.requests), str(r.failed),
                 f"{r.attainment:.1%}", f"{r.goodput:.2f}", f"{r.worker_seconds:.0f}",
                 f"{r.goodput_per_worker_s:.3f}", "-" if r.vs_peak is None else f"{r.vs_peak:.2f}x",
                 "-" if r.dynamo_goodput_requests is None else str(r.dynamo_goodput_requests)]
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


# --- the Dynamo side: everything below imports dynamo lazily, in .venv-dynamo ---

def stub_aisimulate() -> None:
    """Empty stand-ins for the modules Dynamo's planner imports at load time but whose wheel cannot be had
    here: any use raises ImportError, which Dynamo's own fallbacks catch (see the module docstring)."""
    if importlib.util.find_spec("aisimulate_core") is not None:
        return

    def missing(*_: Any, **__: Any) -> Any:
        raise ImportError("aisimulate is not installed")

    class Missing:
        def __init__(self, *_: Any, **__: Any) -> None:
            missing()
        best_available = from_legacy_engine_config = normalize_config = classmethod(missing)

    for name in ("aisimulate", "aisimulate.runner", "aisimulate_core", "aisimulate_core.sdk",
                 "aisimulate_core._native"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["aisimulate.runner"].canonical_performance_config = missing
    for name in ("aisimulate_core.sdk", "aisimulate_core._native"):
        sys.modules[name].ForwardPassPerfModelConfig = Missing
        sys.modules[name].RustForwardPassPerfModel = Missing


def profile_npz(path: Path, resolution: int = 100) -> Path:
    """Our mocker's step costs (Llama-3.1-8B on an H100 SXM) in the NPZ Dynamo's mocker reads
    (dynamo.mocker.utils.planner_profiler_perf_data_converter): TTFT by prompt length (nothing cached), and
    decode ITL by (active KV tokens, context length), the batch being their ratio."""
    import numpy as np

    from dynamo_pd.engines.mocker.profile import h100_llama8b

    p = h100_llama8b()
    isl = np.linspace(1, CONTEXT_TOKENS, resolution)
    capacity = kv_tokens()
    kv = np.linspace(0, capacity, resolution)
    ctx = np.linspace(1, CONTEXT_TOKENS, resolution)
    itl = np.array([[p.decode_time_ms(max(1.0, min(MAX_NUM_SEQS, k / c)), c) for c in ctx] for k in kv])
    np.savez(path, prefill_isl=isl, prefill_ttft_ms=np.array([p.prefill_time_ms(n, 0) for n in isl]),
             decode_active_kv_tokens=kv, decode_context_length=ctx, decode_itl=itl)
    return path


def kv_tokens() -> int:
    from dynamo_pd.engines.mocker.profile import h100_llama8b
    return int(KV_CACHE_GIB * 2**30) // h100_llama8b().kv_bytes_per_token


def engine_args(role: str, timing: str, npz: Path | None) -> dict:
    """Dynamo mocker engine args for one pool (max_model_len is what the planner's prefill rule divides by)."""
    engine: dict[str, Any] = {"worker_type": role, "max_model_len": CONTEXT_TOKENS}
    if timing == "ours":
        engine.update(block_size=BLOCK_TOKENS, num_gpu_blocks=kv_tokens() // BLOCK_TOKENS,
                      max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_BATCHED_TOKENS,
                      kv_transfer_bandwidth=40.0, kv_transfer_bytes_per_token=131072,
                      timing_model={"type": "external", "provider": "dynamo_profile", "config": {"path": str(npz)}})
    return {"engine": engine}


def replay(trace: Path, timing: str, npz: Path | None, slo: Slo, prefill: int, decode: int,
           planner: dict | None) -> Any:
    from dynamo.replay import run_trace_replay

    return run_trace_replay(
        str(trace), prefill_engine_args=engine_args("prefill", timing, npz),
        decode_engine_args=engine_args("decode", timing, npz), num_prefill_workers=prefill,
        num_decode_workers=decode, router_mode="kv_router", trace_block_size=TRACE_BLOCK_TOKENS,
        sla_ttft_ms=slo.ttft_ms, sla_itl_ms=slo.itl_ms, planner_config=planner, capture_per_request=True)


def planner_config(target: str, work: Path, interval_s: int) -> dict:
    # advisory is forced off-cluster by the replay itself; the reports go to a scratch folder, not the cwd
    return {"mode": "disagg", "backend": "mocker", "environment": "virtual", "optimization_target": target,
            "max_gpu_budget": BUDGET, "load_adjustment_interval_seconds": interval_s,
            "report_output_dir": str(work / "planner_reports"), "report_interval_hours": None,
            "live_dashboard_port": 0, "control_api_port": 0}


def run_trace(label: str, rows: list[dict], timing: str, target: str, args: argparse.Namespace, slo: Slo,
              npz: Path, work: Path) -> tuple[list[Run], dict]:
    trace = work / f"trace_{label.split(':')[0]}_{len(rows)}.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t0 = time.monotonic()
    report = replay(trace, timing, npz, slo, 1, 1,
                    planner_config(target, work, args.interval_s))
    wall = {"planner": time.monotonic() - t0}
    s = report.summary
    targets = planner_targets(report.planner.ticks)
    outcomes = [outcome(r) for r in report.per_request]
    worker_s = s["prefill_worker_seconds"] + s["decode_worker_seconds"]
    duration = window_s(outcomes)
    # the average split: Dynamo's worker-seconds per pool over the window
    avg_p, avg_d = (s["prefill_worker_seconds"] / duration, s["decode_worker_seconds"] / duration) if duration \
        else (1.0, 1.0)
    top = peak(targets)
    runs = [make_run(label, f"Dynamo planner ({target})", avg_p, avg_d, outcomes, slo, worker_s,
                     dynamo_goodput_requests=s.get("goodput_completed_requests"), peak=top)]
    statics = [("static peak", *top)] + [(f"static average {p}P{d}D", p, d) for p, d in average_splits(avg_p, avg_d)]
    for config, p, d in statics:
        t0 = time.monotonic()
        rep = replay(trace, timing, npz, slo, p, d, None)
        wall[config] = time.monotonic() - t0
        runs.append(make_run(label, config, p, d, [outcome(r) for r in rep.per_request], slo,
                             dynamo_goodput_requests=rep.summary.get("goodput_completed_requests")))
    rate_vs_peak(runs)
    changes = [(t["at_ms"] / 1e3, tgt) for t, tgt, before in
               zip(report.planner.ticks, targets, [(1, 1), *targets]) if tgt != before]
    detail = {"ticks": report.planner.total_ticks, "target_changes": changes, "peak": top,
              "planner_metadata": {k: report.planner.metadata.get(k) for k in ("mode", "bootstrap")},
              "dynamo_summary": {k: s.get(k) for k in (
                  "duration_ms", "prefill_worker_seconds", "decode_worker_seconds", "goodput_completed_requests",
                  "median_ttft_ms", "p90_ttft_ms", "median_itl_ms", "prefix_cache_reused_ratio")},
              "wall_s": wall}
    return runs, detail


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.planner_dynamo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated, of {', '.join(WORKLOADS)} (both)")
    p.add_argument("--quick", action="store_true", help=f"mooncake: {QUICK_TRACE_REQUESTS} trace rows")
    p.add_argument("--trace-requests", type=int,
                   help=f"mooncake: rows ({TRACE_REQUESTS}; --quick {QUICK_TRACE_REQUESTS})")
    p.add_argument("--periods", type=int, default=SINUSOID["periods"], help="sinusoid: periods (2)")
    p.add_argument("--period-s", type=float, default=SINUSOID["period_s"],
                   help="sinusoid: one period, simulated s (60)")
    p.add_argument("--low", type=float, default=SINUSOID["low"], help="sinusoid: the lowest rate, req/s (1)")
    p.add_argument("--high", type=float, default=SINUSOID["high"], help="sinusoid: the highest rate, req/s (24)")
    p.add_argument("--isl", type=int, default=SINUSOID["isl"], help="sinusoid: input tokens per request (3000)")
    p.add_argument("--osl", type=int, default=SINUSOID["osl"], help="sinusoid: output tokens per request (150)")
    p.add_argument("--seed", type=int, default=SINUSOID["seed"], help="sinusoid: its arrivals' seed (0)")
    p.add_argument("--timing", default="ours,dynamo",
                   help="comma-separated engine timings, each a block of runs: ours (our mocker's H100 8B profile) "
                        "and dynamo (Dynamo's mocker defaults)")
    p.add_argument("--planner-target", default="throughput,latency",
                   help="comma-separated optimization_targets of Dynamo's planner, each a block of runs "
                        "(throughput: its default; latency)")
    p.add_argument("--interval-s", type=int, default=5,
                   help="its load_adjustment_interval_seconds (Dynamo's default 5; ours --quick: 5)")
    p.add_argument("--ttft-slo-ms", type=float, default=TTFT_SLO_MS)
    p.add_argument("--itl-slo-ms", type=float, default=ITL_SLO_MS)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--dynamo-python", type=Path, default=DYNAMO_PYTHON)
    p.add_argument("--timeout-s", type=float, default=900, help="bound on the re-run under --dynamo-python")
    args = p.parse_args(argv)
    if args.trace_requests is None:
        args.trace_requests = QUICK_TRACE_REQUESTS if args.quick else TRACE_REQUESTS
    args.workloads = args.workloads.split(",")
    if unknown := set(args.workloads) - set(WORKLOADS):
        p.error(f"--workloads: unknown {', '.join(sorted(unknown))}; choose from {', '.join(WORKLOADS)}")
    if not 0 < args.low < args.high:
        p.error(f"need 0 < --low < --high, got {args.low:g}, {args.high:g}")
    args.timing = args.timing.split(",")
    if unknown := set(args.timing) - {"ours", "dynamo"}:
        p.error(f"--timing: unknown {', '.join(sorted(unknown))}")
    args.planner_target = args.planner_target.split(",")
    if unknown := set(args.planner_target) - {"throughput", "latency"}:
        p.error(f"--planner-target: unknown {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if importlib.util.find_spec("dynamo") is None or importlib.util.find_spec("dynamo.replay") is None:
        if not args.dynamo_python.exists():
            raise SystemExit(f"error: no Dynamo here and no {args.dynamo_python} (see the module docstring)")
        done = subprocess.run([str(args.dynamo_python), "-m", "benchmarks.planner_dynamo", *argv], cwd=ROOT,
                              timeout=args.timeout_s)
        raise SystemExit(done.returncode)
    os.environ.setdefault("DYN_LOG", "warn")  # the replay logs every routing decision at info
    stub_aisimulate()
    prov = provenance.collect("python -m benchmarks.planner_dynamo", argv)
    slo = Slo(args.ttft_slo_ms, args.itl_slo_ms)
    from importlib.metadata import version
    runs: list[Run] = []
    details: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="planner_dynamo_") as tmp:
        work = Path(tmp)
        npz = profile_npz(work / "h100_llama8b.npz")
        traces: dict[str, str] = {}
        for workload in args.workloads:
            if workload == "sinusoid":
                rows = sinusoid_rows(args.low, args.high, args.period_s, args.periods, args.isl, args.osl,
                                     args.seed)
                traces[workload] = (
                    f"sinusoid: {len(rows)} requests, Poisson arrivals whose rate follows {args.low:g} .. "
                    f"{args.high:g} req/s over {args.periods} periods of {args.period_s:g} s (seed {args.seed}), "
                    f"{args.isl} input and {args.osl} output tokens, no prefix shared; the rows `python -m "
                    f"benchmarks.planner --quick --periods 2` replays (benchmarks.planner.sinusoid_file, "
                    f"timestamps in simulated ms)")
            else:
                rows = trace_rows(TRACE, args.trace_requests)
                traces[workload] = (f"mooncake: the conversation trace's first {len(rows)} rows that fit "
                                    f"{CONTEXT_TOKENS} tokens (of {sum(1 for _ in TRACE.open())}; no more fit)")
            for timing in args.timing:
                for target in args.planner_target:
                    label = f"{workload}: {timing} timing, {target}"
                    found, details[label] = run_trace(label, rows, timing, target, args, slo, npz, work)
                    runs += found
                    print(table_md(found), flush=True)
    timing = ("`ours`: our mocker's profile, Llama-3.1-8B bf16 on one H100 SXM (roofline), through Dynamo's "
              f"mocker NPZ timing; {KV_CACHE_GIB:g} GiB of KV, {BLOCK_TOKENS}-token blocks, {MAX_NUM_SEQS} "
              f"sequences, {MAX_BATCHED_TOKENS} batched tokens, 40 GB/s KV hand-off. `dynamo`: Dynamo's mocker "
              "defaults (its built-in polynomial timing, 16384 blocks of 64 tokens, 256 sequences, 8192 batched "
              "tokens)")
    note = (f"NVIDIA Dynamo {version('ai-dynamo')} offline replay (dynamo.replay.run_trace_replay), KV router, "
            f"disaggregated prefill + decode; all times simulated. Engine timing: {timing}. Planner: "
            f"optimization_target {' and '.join(args.planner_target)} (load-based; neither reads the SLOs), every "
            f"{args.interval_s} s, GPU budget {BUDGET}, from 1P1D. Workloads: {'; '.join(traces.values())}. "
            f"SLA: TTFT <= {slo.ttft_ms:g} ms and per-request "
            f"ITL <= {slo.itl_ms:g} ms (as benchmarks/planner.py). Planner worker-seconds are Dynamo's own "
            f"(prefill_worker_seconds + decode_worker_seconds); static ones workers x the window.")
    args.out.mkdir(parents=True, exist_ok=True)
    title = "NVIDIA Dynamo's planner on " + " and ".join(
        {"sinusoid": "the sinusoid", "mooncake": "the Mooncake conversation trace"}[w] for w in args.workloads)
    summary = {"title": title, "note": note, "provenance": asdict(prov), "dynamo_version": version("ai-dynamo"),
               "slo": asdict(slo), "workloads": args.workloads, "timing": args.timing,
               "planner_target": args.planner_target, "runs": [asdict(r) for r in runs],
               "details": details}
    (args.out / "summaries.json").write_text(json.dumps(summary, indent=1) + "\n")
    changes = "".join(f"\n{label}: the planner's targets (simulated s, (prefill, decode)): "
                      f"{', '.join(f'{t:g} s {p}P{d}D' for t, (p, d) in d['target_changes']) or 'none'}.\n"
                      for label, d in details.items())
    (args.out / "table.md").write_text(f"# {summary['title']}\n\n{prov.markdown()}\n\n{note}\n\n"
                                       f"{table_md(runs)}{changes}")
    print(f"wrote {args.out}/table.md, summaries.json", flush=True)


if __name__ == "__main__":
    main()
