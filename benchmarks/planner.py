"""The planner against static deployments, on an open-loop replay of a varying load (mocker workers).

    python -m benchmarks.planner                   # the sinusoid and the Mooncake trace, in full (~1 h)
    python -m benchmarks.planner --quick           # one short period of the sinusoid, fewer trace rows
    python -m benchmarks.planner --workloads sinusoid --periods 2

Workloads (arrivals on a schedule, aiperf's fixed-schedule replay of a mooncake_trace file; not a closed
loop, which would slow its arrivals down exactly when the deployment falls behind):
  sinusoid  --low .. --high req/s (1 .. 24), --periods periods of --period-s each, starting at the low;
            Poisson arrivals along it, --isl / --osl tokens, every prompt its own (no prefix shared)
  mooncake  the Mooncake conversation trace at its own timestamps (benchmarks/data, the rows that fit the
            model's context, as router_policies replays them)
Deployments, each started fresh per workload:
  planner         `serve --planner` from 1 prefill + 1 decode worker, its SLOs the goodput bounds
  static peak     the counts the planner chose at its peak (the decision with the most workers in all), all
                  the time
  static average  the planner's average worker count, split as the planner split it on average (rounded
                  down and up: both are run, the better is the best static deployment of that size)
Reported per run: SLA attainment (the share of requests within both bounds; a failed one is not),
goodput (good requests/s), worker-seconds (static: workers x duration; planner: its workers' lifetimes,
draining included, over the same window), goodput per worker-second and its ratio to the static peak's,
failed requests; for the planner, how its predicted TTFT compares with the measured median of each
interval. All times are simulated (the mocker's clock, --speedup). Writes summaries.json, table.md and
planner_<workload>.png (load, replicas, TTFT and ITL over time) into --out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from benchmarks import deploy, report, sinusoid
from benchmarks.aiperf_run import Record, Slo, Workload
from benchmarks.router_policies import TRACE_BLOCK_TOKENS, trace_file
from benchmarks.session import Session, add_common_args, fill_defaults, worker_args
from dynamo_pd.planner.model import Costs, Limits, Load, Offsets, PoolModel, State

WORKLOADS = ("sinusoid", "mooncake")
# a simulated 8B model on H100s (agg_vs_disagg's workload), SLOs its peak needs ~9 workers for
# --quick (the quick_ ones): one shorter period of the same requests, so its peak still needs many workers
# (the planner's gain is in the counts between its least and its most)
DEFAULTS = dict(periods=3, quick_periods=1, period_s=90.0, quick_period_s=60.0, low=1.0, high=24.0, isl=3000,
                osl=150, ttft_slo_ms=250.0, itl_slo_ms=8.0, interval_s=10.0, quick_interval_s=5.0,
                cooldown_s=30.0, quick_cooldown_s=15.0, budget=16, trace_requests=100, quick_trace_requests=40,
                kv_cache_memory_gb=54.0, speedup=0.25)
_SCRAPED = ("dynamo_pd_planner_worker_seconds_total", "dynamo_pd_planner_registered_workers")
WARM_UP_INTERVALS = 2  # the planner's first intervals: it has no step costs yet, then no trend


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.planner", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--periods", type=int, help="sinusoid: periods (3; --quick 1)")
    p.add_argument("--period-s", type=float, help="sinusoid: one period, simulated s (90; --quick 60)")
    p.add_argument("--low", type=float, help="sinusoid: the lowest rate, req/s (1)")
    p.add_argument("--high", type=float, help="sinusoid: the highest rate, req/s (24)")
    p.add_argument("--isl", type=int, help="sinusoid: input tokens per request (3000)")
    p.add_argument("--osl", type=int, help="sinusoid: output tokens per request (150)")
    p.add_argument("--trace-requests", type=int, help="mooncake: trace rows to replay (100; --quick 40)")
    p.add_argument("--ttft-slo-ms", type=float, help="the TTFT bound: goodput's and the planner's SLO (250)")
    p.add_argument("--itl-slo-ms", type=float,
                   help="the ITL bound (aiperf's per-request inter_token_latency) (8)")
    p.add_argument("--interval-s", type=float, help="the planner's interval, simulated s (10; --quick 5)")
    p.add_argument("--cooldown-s", type=float, help="its cool-down, simulated s (30; --quick 15)")
    p.add_argument("--budget", type=int, help="its budget of workers (16)")
    p.add_argument("--predictor", default="trend", choices=["trend", "constant"],
                   help="its predictor (trend)")
    p.add_argument("--kv-cache-memory-gb", type=float,
                   help="simulated KV memory per worker (54: an 8B model on "
                                                             "an 80 GB H100)")
    args = p.parse_args(argv)
    if args.engine != "mocker":
        p.error("the planner benchmark runs mocker workers (--engine mocker)")
    fill_defaults(args, DEFAULTS)
    args.workloads = args.workloads.split(",")
    if unknown := [w for w in args.workloads if w not in WORKLOADS]:
        p.error(f"--workloads: unknown {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    if not 0 < args.low < args.high:
        p.error(f"need 0 < --low < --high, got {args.low:g}, {args.high:g}")
    return args


def sinusoid_file(out: Path, args: argparse.Namespace, speedup: float) -> tuple[Path, int]:
    """A mooncake_trace file of the sinusoid (benchmarks.sinusoid.rows, timestamps in real ms)."""
    found = sinusoid.rows(args.low, args.high, args.period_s, args.periods, args.isl, args.osl, args.seed,
                          TRACE_BLOCK_TOKENS, speedup)
    path = out / "sinusoid_trace.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in found))
    return path, len(found)


class PlannerScraper:
    """Reads the planner's /metrics every second (real) in a thread: its workers' seconds and counts."""

    def __init__(self, url: str) -> None:
        self.url, self.samples = url, []  # (wall time, {series: value})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=10) as response:
                    text = response.read().decode()
            except OSError:
                text = ""
            values = {}
            for line in text.splitlines():
                if line.startswith(_SCRAPED):
                    key, _, value = line.rpartition(" ")
                    values[key] = float(value)
            if values:
                self.samples.append((time.time(), values))
            self._stop.wait(1.0)

    def __enter__(self) -> PlannerScraper:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def worker_seconds(self, start: float, end: float) -> float:
        """Real seconds of the planner's workers between two wall-clock times (interpolated)."""
        times = [t for t, _ in self.samples]
        total = [sum(v for k, v in values.items() if k.startswith("dynamo_pd_planner_worker_seconds_total"))
                 for _, values in self.samples]
        return float(np.interp(end, times, total) - np.interp(start, times, total))


@dataclass
class Run:
    config: str
    workload: str
    prefill: float  # workers: a static count, or the planner's average
    decode: float
    requests: int
    failed: int
    good: int
    duration_s: float  # simulated
    worker_seconds: float  # simulated
    attainment: float = 0.0
    goodput: float = 0.0
    goodput_per_worker_s: float = 0.0
    vs_peak: float | None = None  # goodput per worker-second / the static peak's
    peak: dict[str, int] = field(default_factory=dict)  # the planner's: its decision with the most workers

    def __post_init__(self) -> None:
        self.attainment = self.good / self.requests if self.requests else 0.0
        self.goodput = self.good / self.duration_s if self.duration_s else 0.0
        self.goodput_per_worker_s = self.good / self.worker_seconds if self.worker_seconds else 0.0


def window(records: list[Record], speedup: float) -> tuple[float, float]:
    """Wall-clock start and end (real s) of the successful requests: aiperf's benchmark duration."""
    ok = [r for r in records if r.error is None]
    return (min(r.start_ns for r in ok) / 1e9,
            max(r.start_ns / 1e9 + r.latency_ms / 1e3 / speedup for r in ok))


def planner_flags(args: argparse.Namespace, speedup: float, record: Path) -> tuple[str, ...]:
    """serve's planner flags, simulated time turned into real (SLOs and intervals / speedup)."""
    return ("--planner", "--ttft-slo", f"{args.ttft_slo_ms / speedup:g}", "--itl-slo",
            f"{args.itl_slo_ms / speedup:g}", "--planner-interval-s", f"{args.interval_s / speedup:g}",
            "--cooldown-s", f"{args.cooldown_s / speedup:g}",
            "--budget", str(args.budget), "--predictor", args.predictor, "--planner-record", str(record))


def planner_url(serve_log: Path) -> str:
    """The planner's /metrics URL, from serve's line naming it (it comes once the planner starts)."""
    urls = deploy.metrics_urls(serve_log, lambda found: ["planner"] in found.values())
    return next(url for url, names in urls.items() if names == ["planner"])


def read_record(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def intervals(decisions: list[dict], records: list[Record], speedup: float, slo: Slo) -> list[dict]:
    """Per planner interval (its prefill or aggregated pool's decisions): the predicted TTFT p50 for the
    requests arriving until the next decision, and what they measured (simulated ms)."""
    ttft_pool = [d for d in decisions if d["pool"] != "decode"]
    rows = []
    for i, (d, following) in enumerate(zip(ttft_pool, ttft_pool[1:])):
        inside = [r for r in records if d["time"] <= r.start_ns / 1e9 < following["time"] and r.error is None]
        ttfts = [r.ttft_ms for r in inside if r.ttft_ms is not None]
        tpots = [r.itl_ms for r in inside if r.itl_ms is not None]
        predicted = (d["prediction"] or {}).get("ttft_p50_s")
        given = model_on(d, [(r.start_ns / 1e9 - d["time"], r.prompt_tokens - r.cached_tokens) for r in inside])
        rows.append({"time": d["time"], "index": i, "requests": len(inside), "target": d["target"],
                     "predicted_ttft_ms": None if predicted is None else predicted * 1e3 * speedup,
                     "model_on_arrivals_ms": None if given is None else given * 1e3 * speedup,
                     "measured_ttft_p50_ms": float(np.median(ttfts)) if ttfts else None,
                     "measured_tpot_p50_ms": float(np.median(tpots)) if tpots else None,
                     "good": sum(report.is_good(r, slo) for r in inside)})
    return rows


def model_on(decision: dict, arrivals: list[tuple[float, int]]) -> float | None:
    """The planner's TTFT model for a decision's interval run on the requests that arrived in it (real s from
    the decision, uncached tokens) instead of at the rate forecast, with the costs, queue and offsets it had
    then: the model's own error, apart from the forecast's (None where the decision had no model)."""
    if not decision.get("costs") or not decision["prediction"] or decision["pool"] == "decode":
        return None
    model = PoolModel(Costs(**decision["costs"]), Load(decision.get("forecast_rate") or 0.0, ()),
                      State(decision["queued_prefill_tokens"]), Limits(**decision["limits"]), prefills=True,
                      decodes=decision["pool"] == "aggregated", horizon_s=decision["interval_s"],
                      attainment=0.5, offsets=Offsets(**decision["offsets"]))
    return model.ttft_p50_given(decision["target"], arrivals)


def peak_counts(pools: dict[str, list[int]]) -> dict[str, int]:
    """The counts of the planner's decision with the most workers in all (`pools`: each pool's targets, a
    decision each interval): a deployment it chose at once, not each pool's most, which may be of two
    moments and exceed its budget."""
    return dict(zip(pools, max(zip(*pools.values()), key=sum, default=(1,) * len(pools))))


def prediction_md(rows: list[dict], ttfts: list[float]) -> tuple[str, float | None]:
    """How many intervals after the warm-up had their predicted TTFT within 25% of the measured median; and,
    beside it, how many a prediction of the exact median of `ttfts` (the TTFTs measured after the warm-up)
    would have had by chance alone: an interval's median is that of its few requests (the medians of as many
    of `ttfts`, drawn at random, are within 25% of the median of them all that often)."""
    judged = [r for r in rows[WARM_UP_INTERVALS:] if r["predicted_ttft_ms"] and r["measured_ttft_p50_ms"]
              and r["requests"] >= 5]
    if not judged:
        return "no interval after the warm-up had both a prediction and 5 requests", None
    errors = [r["predicted_ttft_ms"] / r["measured_ttft_p50_ms"] - 1 for r in judged]
    within = sum(abs(e) <= 0.25 for e in errors) / len(errors)
    given = [r["model_on_arrivals_ms"] / r["measured_ttft_p50_ms"] - 1 for r in judged
             if r.get("model_on_arrivals_ms") is not None]
    rng, median = np.random.default_rng(0), float(np.median(ttfts))
    chance = np.mean([np.mean(np.abs(np.median(rng.choice(ttfts, (1000, r["requests"])), axis=1) / median - 1)
                              <= 0.25) for r in judged])
    return (f"predicted TTFT within +-25% of the measured median in {within:.0%} of {len(judged)} intervals "
            f"after the warm-up (median error {np.median(errors):+.0%}, worst {max(errors, key=abs):+.0%}); "
            f"predicting the run's own median would have been within 25% in {chance:.0%} of them (the "
            f"spread of a median of so few requests)" + (
                f"; the model run on each interval's own arrivals instead of the rate forecast: within 25% in "
                f"{sum(abs(e) <= 0.25 for e in given)} of {len(given)} (worst {max(given, key=abs):+.0%})"
                if given else "")), within


def runs_md(runs: list[Run]) -> str:
    head = ["workload", "config", "prefill", "decode", "requests", "failed", "SLA attainment",
            "goodput req/s", "worker-s", "goodput / worker-s", "vs static peak"]
    rows = [f"| {' | '.join(head)} |", f"|{'---|' * len(head)}"]
    for r in runs:
        cells = [r.workload, r.config, f"{r.prefill:.2f}", f"{r.decode:.2f}", str(r.requests),
                 f"{r.failed}" + (" **FAILED**" if r.failed else ""), f"{r.attainment:.1%}",
                 f"{r.goodput:.2f}",
                 f"{r.worker_seconds:.0f}", f"{r.goodput_per_worker_s:.3f}",
                 "-" if r.vs_peak is None else f"{r.vs_peak:.2f}x"]
        rows.append(f"| {' | '.join(cells)} |")
    return "\n".join(rows) + "\n"


def plot(path: Path, workload: str, rows: list[dict], scraper_samples: list, t0: float, records: list[Record],
         slo: Slo, speedup: float) -> None:
    plt = report._plt()
    fig, axes = plt.subplots(3, 1, figsize=(8, 7.5), sharex=True)
    sim = lambda wall: (wall - t0) * speedup  # noqa: E731 - wall clock -> simulated s since the first request
    starts = sorted(sim(r.start_ns / 1e9) for r in records)
    if starts:
        edges = np.arange(0, starts[-1] + 5, 5)
        counts, _ = np.histogram(starts, edges)
        axes[0].step(edges[:-1], counts / 5, where="post", color="gray", label="arrivals req/s")
    twin = axes[0].twinx()
    for pool in ("prefill", "decode", "aggregated"):
        series = [(sim(t), v[key]) for t, v in scraper_samples
                  for key in v if key == f'dynamo_pd_planner_registered_workers{{pool="{pool}"}}']
        if series:
            twin.step([s[0] for s in series], [s[1] for s in series], where="post", label=f"{pool} workers")
    axes[0].set_ylabel("req/s")
    twin.set_ylabel("workers")
    axes[0].legend(loc="upper left", fontsize=7)
    twin.legend(loc="upper right", fontsize=7)
    xs = [sim(r["time"]) for r in rows]
    axes[1].plot(xs, [r["measured_ttft_p50_ms"] for r in rows], marker="o", label="measured TTFT p50")
    axes[1].plot(xs, [r["predicted_ttft_ms"] for r in rows], marker="x", label="predicted TTFT p50")
    axes[1].axhline(slo.ttft_ms, color="red", linestyle="--", label="SLO")
    axes[1].set_ylabel("ms")
    axes[1].legend(fontsize=7)
    axes[2].plot(xs, [r["measured_tpot_p50_ms"] for r in rows], marker="o",
                 label="measured ITL p50 (per request)")
    axes[2].axhline(slo.itl_ms, color="red", linestyle="--", label="SLO")
    axes[2].set_ylabel("ms")
    axes[2].set_xlabel("simulated s")
    axes[2].legend(fontsize=7)
    axes[0].set_title(f"planner, {workload}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    slo = Slo(args.ttft_slo_ms, args.itl_slo_ms)
    session = Session("planner", args, slo, argv=argv, runs=4 * len(args.workloads))  # at most
    speedup = session.speedup
    mocker = worker_args(args, ["--kv-cache-memory-gb", f"{args.kv_cache_memory_gb:g}"])
    runs: list[Run] = []
    extra: dict = {"runs_planner": [], "intervals": {}, "prediction": {}, "best_static_average": {}}
    for w, name in enumerate(args.workloads):
        if name == "sinusoid":
            trace, requests = sinusoid_file(session.out, args, speedup)
        else:
            trace, requests = trace_file(session.out, args.trace_requests, 1, speedup), args.trace_requests
        dataset = ["--input-file", str(trace), "--custom-dataset-type", "mooncake_trace", "--isl-block-size",
                   str(TRACE_BLOCK_TOKENS)]
        workload = Workload(name, dataset, requests=requests, trace=trace)
        last_ms = json.loads(trace.read_text().splitlines()[-1])["timestamp"]
        args.max_run_s = max(args.max_run_s, last_ms / 1e3 + 120)  # aiperf's duration bound: the whole replay
        seed = args.seed + 1000 * w  # the same prompts for every deployment of a workload

        record = session.out / f"planner_{name}.jsonl"
        # serve's planner flags ride with the engine flags: serve takes what it knows and passes on the rest
        d = deploy.Deployment("planner", "mocker", prefill=1, decode=1, worker_args=(*mocker, *planner_flags(
            args, speedup, record)))
        logs = session.out / "logs" / f"planner_{name}"
        with deploy.running(d, logs) as url:
            with PlannerScraper(planner_url(logs / "serve.log")) as scraper:
                summary = session.measure(url, "planner", name, None, workload, seed)
        records = session.records[("planner", name)]
        t0 = min((r.start_ns for r in records), default=0) / 1e9  # its first request, for the plot
        start, end = window(records, speedup)
        decisions = read_record(record)
        seconds = scraper.worker_seconds(start, end) * speedup
        duration = (end - start) * speedup
        pools = {pool: [d["target"] for d in decisions if d["pool"] == pool]
                 for pool in ("prefill", "decode")}
        share = {pool: float(np.mean(v)) if v else 0.0 for pool, v in pools.items()}
        average = seconds / duration if duration else 0.0
        planner = Run("planner", name, share["prefill"], share["decode"], summary.ok + summary.failed,
                      summary.failed, summary.good, duration, seconds,
                      peak=peak_counts(pools))
        rows = intervals(decisions, records, speedup, slo)
        judged_from = rows[min(WARM_UP_INTERVALS, len(rows) - 1)]["time"] if rows else 0.0
        text, within = prediction_md(rows, [r.ttft_ms for r in records if r.error is None and r.ttft_ms is not None
                                            and r.start_ns / 1e9 >= judged_from])
        extra["intervals"][name], extra["prediction"][name] = rows, {"text": text, "within_25": within}
        plot(session.out / f"planner_{name}.png", name, rows, scraper.samples, t0, records, slo, speedup)

        # the static deployments: the planner's peak, and its average size split either way its average
        # split rounds (the better of the two is the best static deployment of that size)
        n = max(2, round(average))
        prefill_share = share["prefill"] / max(1e-9, share["prefill"] + share["decode"])
        splits = sorted({min(n - 1, max(1, f(n * prefill_share))) for f in (math.floor, math.ceil)})
        statics = [("static peak", planner.peak["prefill"], planner.peak["decode"])] + [
            (f"static average {p}P{n - p}D", p, n - p) for p in splits]
        session.runs -= 2 - len(splits)  # one split where both roundings agree
        found_runs = [planner]
        for config, prefill, decode in statics:
            d = deploy.Deployment(config, "mocker", prefill=prefill, decode=decode, worker_args=mocker)
            with deploy.running(d, session.out / "logs" / f"{config}_{name}".replace(" ", "_")) as url:
                summary = session.measure(url, config, name, None, workload, seed)
            records = session.records[(config, name)]
            start, end = window(records, speedup) if summary.ok else (0.0, 0.0)
            duration = (end - start) * speedup
            found_runs.append(Run(config, name, prefill, decode, summary.ok + summary.failed, summary.failed,
                                  summary.good, duration, (prefill + decode) * duration))
        peak_rate = found_runs[1].goodput_per_worker_s
        for r in found_runs:
            r.vs_peak = r.goodput_per_worker_s / peak_rate if peak_rate else None
        best = max(found_runs[2:], key=lambda r: r.goodput_per_worker_s)
        extra["best_static_average"][name] = best.config
        runs += found_runs
    note = (f"Mocker workers (--speedup {speedup:g}); all times simulated. SLOs (the planner's, and "
            f"goodput's "
            f"bounds): TTFT <= {slo.ttft_ms:g} ms, ITL (aiperf's per-request inter_token_latency) <= "
            f"{slo.itl_ms:g} ms. Sinusoid: {args.low:g}..{args.high:g} req/s, {args.periods} x "
            f"{args.period_s:g} s, "
            f"{args.isl} / {args.osl} tokens; Mooncake: {args.trace_requests} rows. Planner: interval "
            f"{args.interval_s:g} s, cool-down {args.cooldown_s:g} s, budget {args.budget}, {args.predictor} "
            f"predictor. Workers: the planner's are its average over the run.")
    extra["runs_planner"] = [asdict(r) for r in runs]
    extra["planner_md"] = "## Planner vs static\n\n" + runs_md(runs) + "".join(
        f"\n{name}: {p['text']}; the best static deployment of the planner's average size: "
        f"{extra['best_static_average'][name]}.\n" for name, p in extra["prediction"].items())
    report.write(session.out, "The planner against static deployments", note, session.provenance,
                 session.summaries, session.ttfts, extra)
    print(extra["planner_md"], flush=True)
    pngs = ", ".join(f"planner_{w}.png" for w in args.workloads)
    print(f"wrote {session.out}/table.md, summaries.json, {pngs}", flush=True)
    report.exit_if_failed(session.summaries, session.out)


if __name__ == "__main__":
    main()
