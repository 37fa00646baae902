"""Aggregated vs disaggregated serving at equal resources, swept over load, measured by aiperf.

    python -m benchmarks.agg_vs_disagg                      # mocker: 8 aggregated vs 2 prefill + 6 decode
    python -m benchmarks.agg_vs_disagg --quick              # the same, 3 load points, a few minutes
    python -m benchmarks.agg_vs_disagg --engine native --quick   # 2 aggregated vs 1P1D, each worker on its own core
    python -m benchmarks.agg_vs_disagg --concurrency 4,16,64     # sweep concurrency instead of request rate

Each configuration is started once (frontend + workers, see deploy.py) and aiperf runs every load
point against it with the same synthetic workload (fixed input/output lengths, ignore_eos) and, per
point, the same seed in every configuration. Writes summaries.json, table.md, ttft_cdf.png and
vs_load.png into --out, with TTFT, ITL (gaps between streamed chunks), TPOT (per request, aiperf's
inter_token_latency), end-to-end latency, throughput, goodput (requests/s with TTFT and TPOT both
within bounds, aiperf's --goodput definition) and the lowest load where disaggregation's goodput
beats aggregation's.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import deploy, report
from benchmarks.aiperf_run import Slo, Workload
from benchmarks.session import Session, add_common_args, worker_args

# Per engine: a simulated 8B model on H100s (mocker), or SmolLM2 on this CPU (any real engine).
DEFAULTS = {
    "mocker": dict(workers=8, isl=3000, osl=150, rates="4,8,12,16,20,24", quick_rates="6,14,22", requests=80,
                   quick_requests=40, ttft_slo_ms=500.0, itl_slo_ms=9.0, speedup=0.25),
    "real": dict(workers=2, isl=256, osl=24, rates="0.25,0.5,1,1.5", quick_rates="0.3,1", requests=16,
                 quick_requests=6, ttft_slo_ms=3000.0, itl_slo_ms=200.0, speedup=1.0),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.agg_vs_disagg", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--workers", type=int, help="N: N aggregated workers vs xPyD with x + y = N (mocker 8, else 2)")
    p.add_argument("--prefill", type=int, help="x, the prefill workers of xPyD (default N / 4, at least 1)")
    p.add_argument("--rates", help="request rates to sweep, requests/s, comma-separated")
    p.add_argument("--concurrency", help="sweep these concurrencies instead of request rates")
    p.add_argument("--isl", type=int, help="input tokens per request")
    p.add_argument("--osl", type=int, help="output tokens per request")
    p.add_argument("--requests", type=int, help="requests per load point")
    p.add_argument("--ttft-slo-ms", type=float, help="goodput bound on TTFT")
    p.add_argument("--itl-slo-ms", type=float, help="goodput bound on TPOT (aiperf's per-request inter_token_latency)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=54.0,
                   help="mocker: simulated KV memory per worker (an 8B model on an 80 GB H100 leaves ~54)")
    args = p.parse_args(argv)
    defaults = DEFAULTS["mocker" if args.engine == "mocker" else "real"]
    for key in ("workers", "isl", "osl", "ttft_slo_ms", "itl_slo_ms", "speedup"):
        if getattr(args, key) is None:
            setattr(args, key, defaults[key])
    if args.requests is None:
        args.requests = defaults["quick_requests" if args.quick else "requests"]
    if args.rates is None and args.concurrency is None:
        args.rates = defaults["quick_rates" if args.quick else "rates"]
    if args.rates is not None and args.concurrency is not None:
        p.error("give --rates or --concurrency, not both")
    args.prefill = args.prefill or max(1, args.workers // 4)
    if args.workers < 2 or not 0 < args.prefill < args.workers:
        p.error(f"need N >= 2 workers and 0 < prefill < N, got --workers {args.workers} --prefill {args.prefill}")
    return args


def crossover(summaries: list[report.Summary], agg: str, disagg: str) -> float | None:
    """The lowest load from which on disaggregation's goodput is higher than aggregation's at every load."""
    by_x = {(s.config, s.x): s.goodput for s in summaries}
    found = None
    for x in sorted({s.x for s in summaries}, reverse=True):
        if not by_x.get((disagg, x), 0) > by_x.get((agg, x), float("inf")):
            break
        found = x
    return found


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    n, x = args.workers, args.prefill
    by_rate = args.rates is not None
    loads = [float(v) for v in (args.rates if by_rate else args.concurrency).split(",")]
    mocker = ["--kv-cache-memory-gb", f"{args.kv_cache_memory_gb:g}"] if args.engine == "mocker" else []
    extra = worker_args(args, mocker)
    agg, disagg = f"{n} aggregated", f"{x}P{n - x}D"
    configs = [deploy.Deployment(agg, args.engine, aggregated=n, worker_args=extra),
               deploy.Deployment(disagg, args.engine, prefill=x, decode=n - x, worker_args=extra)]
    slo = Slo(args.ttft_slo_ms, args.itl_slo_ms)
    session = Session("agg_vs_disagg", args, slo, argv=argv, runs=len(configs) * len(loads))
    unit = "req/s" if by_rate else "concurrent"
    for d in configs:
        with deploy.running(d, session.out / "logs" / d.name.replace(" ", "_")) as url:
            for i, load in enumerate(loads):
                workload = Workload(
                    "synthetic", ["--synthetic-input-tokens-mean", str(args.isl),
                                  "--synthetic-input-tokens-stddev", "0",
                                  "--output-tokens-mean", str(args.osl), "--output-tokens-stddev", "0"],
                    requests=args.requests, rate=load if by_rate else None,
                    concurrency=None if by_rate else int(load))
                # a new seed per point (prompts cached at one point must not serve the next), the same per config
                session.measure(url, d.name, f"{load:g} {unit}", load, workload, seed=args.seed + i)
    cross = crossover(session.summaries, agg, disagg)
    time_note = (f"simulated time (mocker, --speedup {session.speedup:g}: measured times x {session.speedup:g})"
                 if args.engine == "mocker" else f"real time ({args.engine} engine, each worker pinned to its cores)")
    note = (f"{agg} vs {disagg}, engine {args.engine}; {args.requests} requests per point, {args.isl} input / "
            f"{args.osl} output tokens; all times in {time_note}. ITL: gaps between streamed chunks, all requests; "
            f"TPOT: per request (latency - TTFT) / (output tokens - 1); goodput: requests/s with TTFT <= "
            f"{slo.ttft_ms:g} ms and TPOT <= {slo.itl_ms:g} ms.")
    cross_md = (f"Disaggregation's goodput exceeds aggregation's from **{cross:g} {unit}** on." if cross is not None
                else "Disaggregation's goodput does not exceed aggregation's at the highest load here.")
    report.write(session.out, f"Aggregated vs disaggregated: {agg} vs {disagg}", note, session.provenance,
                 session.summaries, session.ttfts, {"crossover": cross, "crossover_md": cross_md})
    report.plot_ttft_cdf(session.out / "ttft_cdf.png", session.ttfts,
                         list(dict.fromkeys(s.group for s in session.summaries)))
    report.plot_vs_load(session.out / "vs_load.png", session.summaries, "requests/s" if by_rate else "concurrency")
    print(f"{cross_md}\nwrote {session.out}/table.md, summaries.json, ttft_cdf.png, vs_load.png", flush=True)
    report.exit_if_failed(session.summaries, session.out)


if __name__ == "__main__":
    main()
