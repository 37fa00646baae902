"""KV tiers and peer pulls against neither: the same deployment, router and load, measured by aiperf.

    python -m benchmarks.kv_tiers              # mocker: 16 aggregated workers (simulated H100s), ~15 min
    python -m benchmarks.kv_tiers --quick      # fewer requests, a few minutes

Two deployments of --workers aggregated mocker workers under the default `time` router, which differ only in:
  off  --no-peer-prefixes and no tiers: a prefix is in the chosen worker's pool, or it is computed;
  on   peer pulls, and below each pool a host tier (--kv-host-gb) and a disk tier (--kv-disk-gb).
Each runs both workloads in turn (they share no prompts, so one does not warm the other's cache):
  hot   aiperf's prefix pool of --hot-prefixes prompts of --prefix-tokens tokens, 2.5 times one worker's KV pool
        at the defaults; each request one of them plus its own --question-tokens;
  fits  the same with --fits-prefixes prompts, half of one worker's pool: the tiers have nothing to add
        there, and must not cost.
A closed loop (--concurrency requests in flight), so requests/s is what the deployment sustains, measured
after --warmup-requests of the same prompts (each worker's first meeting with a prefix is a miss either way).
Reported per run: requests/s, output tokens/s, TTFT, KV hit rate and failed requests (aiperf, measured
requests), and from the workers' /metrics, what each run fetched, warm-up included: blocks the host and disk
tiers served back, and peer pulls (pulled, refused, failed, their bytes). Writes summaries.json, table.md,
throughput.png and ttft_cdf.png into --out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from benchmarks import deploy, report
from benchmarks.aiperf_run import Slo, Workload
from benchmarks.session import Session, add_common_args, fill_defaults, worker_args

CONFIGS = ("off", "on")
WORKLOADS = ("hot", "fits")
# A simulated 8B model (128 KiB of KV a token) on H100s: 4 GiB of KV a worker holds 8 prefixes of 4,096 tokens,
# so 20 are 2.5 times a pool and 4 half of one. Host tier the pool's size, disk 4x it (an H100 host has far more
# RAM than that: the smaller tier leaves the disk something to do). --speedup 0.05 keeps the frontend's real
# load (~15 req/s) well under its capacity on 2 cores: at 0.1 its own time already cut the simulated rates ~13%.
DEFAULTS = dict(rounds=2, workers=16, concurrency=128, requests=1200, quick_requests=400, warmup_requests=600,
                quick_warmup_requests=200, hot_prefixes=20, fits_prefixes=4,
                prefix_tokens=4096, question_tokens=128, osl=32, kv_cache_memory_gb=4.0, kv_host_gb=4.0,
                kv_disk_gb=16.0, speedup=0.05, ttft_slo_ms=1000.0, itl_slo_ms=25.0)
# what the workers' /metrics say each run fetched: (series, label to split by)
FETCHED = {"tier hits": ("dynamo_pd_worker_kv_tier_hits_total", "tier"),
           "peer pulls": ("dynamo_pd_worker_kv_peer_pulls_total", "outcome"),
           "peer pull GB": ("dynamo_pd_worker_kv_peer_pull_bytes_total", None)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_tiers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--workers", type=int, help="aggregated mocker workers (16)")
    p.add_argument("--concurrency", type=int, help="requests in flight (128)")
    p.add_argument("--rounds", type=int, help="each configuration this many times, on a fresh deployment, in "
                                              "alternating order (2): run-to-run noise is ~5%% here")
    p.add_argument("--requests", type=int, help="requests per run (1200; --quick 400)")
    p.add_argument("--warmup-requests", type=int, help="sent before each run's measured requests, from the same "
                                                       "prompts: the pools fill (600; --quick 200)")
    p.add_argument("--hot-prefixes", type=int, help="hot: distinct prefixes (20: 2.5 pools at the defaults)")
    p.add_argument("--fits-prefixes", type=int, help="fits: distinct prefixes (4: half a pool)")
    p.add_argument("--prefix-tokens", type=int, help="tokens per prefix (4096)")
    p.add_argument("--question-tokens", type=int, help="each request's own tokens after its prefix (128)")
    p.add_argument("--osl", type=int, help="output tokens per request (32)")
    p.add_argument("--kv-cache-memory-gb", type=float, help="each worker's pool, simulated GiB (4)")
    p.add_argument("--kv-host-gb", type=float, help="on: each worker's host tier, simulated GiB (4)")
    p.add_argument("--kv-disk-gb", type=float, help="on: each worker's disk tier, simulated GiB (16)")
    p.add_argument("--ttft-slo-ms", type=float, help="goodput bound on TTFT (1000)")
    p.add_argument("--itl-slo-ms", type=float, help="goodput bound on TPOT (25)")
    args = p.parse_args(argv)
    if args.engine != "mocker":
        p.error("--engine: this comparison runs mocker workers (the tiers' bandwidths come from its profile)")
    fill_defaults(args, DEFAULTS)
    if args.warmup_requests < 0:
        p.error(f"--warmup-requests must be >= 0, got {args.warmup_requests}")
    for flag in ("rounds", "workers", "concurrency", "requests", "hot_prefixes", "fits_prefixes", "prefix_tokens",
                 "question_tokens", "osl"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    return args


def config_args(args: argparse.Namespace, config: str, disk_dir: Path) -> tuple[str, ...]:
    """The mocker workers' flags of a configuration (serve passes them to every worker)."""
    common = ["--kv-cache-memory-gb", f"{args.kv_cache_memory_gb:g}"]
    if config == "off":
        return worker_args(args, [*common, "--no-peer-prefixes"])
    return worker_args(args, [*common, "--kv-host-gb", f"{args.kv_host_gb:g}", "--kv-disk-gb",
                              f"{args.kv_disk_gb:g}", "--kv-disk-dir", str(disk_dir)])


def workloads(args: argparse.Namespace) -> dict[str, Workload]:
    warmup = ["--warmup-request-count", str(args.warmup_requests)] if args.warmup_requests else []

    def pool(name: str, prefixes: int) -> Workload:
        return Workload(name, ["--synthetic-input-tokens-mean", str(args.question_tokens),
                               "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(args.osl),
                               "--output-tokens-stddev", "0", "--prompt-prefix-pool-size", str(prefixes),
                               "--prompt-prefix-length", str(args.prefix_tokens),
                               *warmup],
                        requests=args.requests, concurrency=args.concurrency)

    return {"hot": pool("hot", args.hot_prefixes), "fits": pool("fits", args.fits_prefixes)}


def scrape(urls: list[str]) -> dict[str, dict[str, float]]:
    """FETCHED's series summed over every worker of every URL, split by their label."""
    totals: dict[str, dict[str, float]] = {name: {} for name in FETCHED}
    for url in urls:
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                for name, (series, label) in FETCHED.items():
                    if sample.name == series:
                        key = sample.labels.get(label, "") if label else ""
                        totals[name][key] = totals[name].get(key, 0.0) + sample.value
    return totals


def fetched_between(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """What the counters grew by (a worker's counters only grow, and a series once rendered stays)."""
    return {name: {k: v - before[name].get(k, 0.0) for k, v in after[name].items()} for name in after}


def fetched_md(rows: list[dict]) -> str:
    lines = ["## What each run fetched (the workers' /metrics)", "",
             "| config | round | workload | host-tier blocks | disk-tier blocks | peer pulls (pulled / refused / "
             "failed) | peer pull GB |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        f = r["fetched"]
        pulls = f["peer pulls"]
        lines.append(f"| {r['config']} | {r['round']} | {r['workload']} | {f['tier hits'].get('host', 0):.0f} | "
                     f"{f['tier hits'].get('disk', 0):.0f} | {pulls.get('pulled', 0):.0f} / "
                     f"{pulls.get('refused', 0):.0f} / {pulls.get('failed', 0):.0f} | "
                     f"{f['peer pull GB'].get('', 0) / 1e9:.2f} |")
    return "\n".join(lines) + "\n"


def ratios_md(runs: list[dict]) -> tuple[str, dict[str, dict]]:
    """on / off per workload: mean requests/s (the throughput) over the rounds, each round's ratio, and the
    TTFT medians; rounds alternate which configuration runs first, so drift of the host cancels out."""
    lines = ["## on / off", "", "| workload | requests/s on / off (mean of rounds) | each round | TTFT p50 off / on "
             "(mean) |", "|---|---|---|---|"]
    ratios = {}
    for w in dict.fromkeys(r["workload"] for r in runs):
        by = {c: [r for r in runs if r["workload"] == w and r["config"] == c] for c in CONFIGS}
        mean = {c: statistics.fmean(r["requests_s"] for r in rs) for c, rs in by.items() if rs}
        if len(mean) < 2 or not mean["off"]:
            continue
        rounds = [on["requests_s"] / off["requests_s"] for off, on in zip(by["off"], by["on"]) if off["requests_s"]]
        ttft = {c: statistics.fmean(r["ttft_p50_ms"] or 0.0 for r in rs) for c, rs in by.items()}
        ratios[w] = {"ratio": mean["on"] / mean["off"], "rounds": rounds}
        lines.append(f"| {w} | **{mean['on'] / mean['off']:.2f}x** ({mean['on']:.1f} / {mean['off']:.1f}) | "
                     f"{', '.join(f'{x:.2f}x' for x in rounds)} | {ttft['off']:.0f} / {ttft['on']:.0f} ms |")
    return "\n".join(lines) + "\n", ratios


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    slo = Slo(args.ttft_slo_ms, args.itl_slo_ms)
    session = Session("kv_tiers", args, slo, argv=argv, runs=args.rounds * len(CONFIGS) * len(WORKLOADS))
    loads = workloads(args)
    runs = []
    for r in range(args.rounds):
        for config in CONFIGS if r % 2 == 0 else CONFIGS[::-1]:
            label = f"{config} #{r + 1}" if args.rounds > 1 else config
            logs = session.out / "logs" / label.replace(" #", "_")
            d = deploy.Deployment(label, "mocker", aggregated=args.workers,
                                  worker_args=config_args(args, config, session.out / "kv-disk"))
            with deploy.running(d, logs) as url:
                urls = deploy.worker_metrics_urls(logs / "serve.log", args.workers)
                for i, (name, workload) in enumerate(loads.items()):
                    before = scrape(urls)
                    # the same seed for a workload under each configuration and round; distinct per workload
                    s = session.measure(url, label, name, None, workload, seed=args.seed + 1000 * i)
                    runs.append({"config": config, "round": r + 1, "workload": name, "requests_s": s.request_s,
                                 "ttft_p50_ms": s.ttft_ms[50], "fetched": fetched_between(before, scrape(urls))})
    ratios_text, ratios = ratios_md(runs)
    note = (f"{args.workers} aggregated mocker workers (a simulated 8B model on H100s, --speedup {session.speedup:g}: "
            f"all times simulated), the `time` router, {args.kv_cache_memory_gb:g} GiB of KV each. off: "
            f"--no-peer-prefixes, no tiers; on: peer pulls, {args.kv_host_gb:g} GiB host tier and "
            f"{args.kv_disk_gb:g} GiB disk tier per worker. {args.rounds} round(s), each a fresh deployment of "
            f"each; {args.requests} measured requests a run after {args.warmup_requests} warm-up ones, "
            f"{args.concurrency} in flight; each one of a pool of prefixes of {args.prefix_tokens} tokens (hot: "
            f"{args.hot_prefixes}, fits: {args.fits_prefixes}) + {args.question_tokens} tokens, {args.osl} output "
            f"tokens. Goodput: TTFT <= {slo.ttft_ms:g} ms and TPOT <= {slo.itl_ms:g} ms.")
    extra = {"ratios": ratios, "fetched": runs, "ratios_md": ratios_text, "fetched_md": fetched_md(runs)}
    report.write(session.out, f"KV tiers and peer pulls, {args.workers} workers", note, session.provenance,
                 session.summaries, session.ttfts, extra)
    report.plot_bars(session.out / "throughput.png", session.summaries, lambda s: s.request_s, "requests/s")
    report.plot_ttft_cdf(session.out / "ttft_cdf.png", session.ttfts, list(loads))
    print(ratios_text, flush=True)
    print(f"wrote {session.out}/table.md, summaries.json, throughput.png, ttft_cdf.png", flush=True)
    report.exit_if_failed(session.summaries, session.out)


if __name__ == "__main__":
    main()
