"""What tracing costs, and whether a trace's times are the client's: the same deployment and load with
tracing off, at a sampling ratio, and with every request traced, side by side.

    python -m benchmarks.tracing_overhead                  # 1P1D mocker, 3 rounds of off / 0.1 / 1
    python -m benchmarks.tracing_overhead --quick          # 2 rounds, fewer requests
    python -m benchmarks.tracing_overhead --engine native  # 1P1D native workers, each on its own core

Tracing is a process flag, so every configuration is its own `serve` (frontend and workers exporting over
OTLP/HTTP into a receiver this process runs, benchmarks/otlp_receiver.py, as they would into a collector).
The configurations take turns, round after round, each round in a rotated order, so that a host that slows
down during the run slows each of them alike; each config's figure is the median over its rounds of each
run's TTFT p50 (and ITL p50). With every request traced, each aiperf request's trace is found by the
X-Request-ID aiperf sent (the request span carries it) and the trace's time from the request's arrival to
the end of its first_token span (the first token's chunk sent) is compared with the TTFT aiperf measured,
whole and less the opening of its connection (which no server sees). Writes summaries.json, table.md and
ttft_cdf.png into --out.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from benchmarks import deploy, report
from benchmarks.aiperf_run import Record, Slo, Workload
from benchmarks.otlp_receiver import OtlpReceiver, Span
from benchmarks.session import Session, add_common_args, fill_defaults, worker_args

OFF, ALL = "off", "every request"
DEFAULTS = {  # mocker: a simulated 8B model on an H100 in real time; native: SmolLM2 on this CPU
    "mocker": dict(isl=2000, osl=32, rate=4.0, requests=120, quick_requests=60, rounds=3, quick_rounds=2,
                   speedup=1.0),
    "real": dict(isl=256, osl=16, rate=0.5, requests=16, quick_requests=8, rounds=3, quick_rounds=2, speedup=1.0),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tracing_overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--ratio", type=float, default=0.1, help="the sampling ratio measured against off (0.1)")
    p.add_argument("--rounds", type=int, help="rounds of every configuration (3; --quick 2)")
    p.add_argument("--rate", type=float, help="requests/s (mocker 4, else 0.5)")
    p.add_argument("--requests", type=int, help="requests per run (mocker 120, else 16; --quick half)")
    p.add_argument("--isl", type=int, help="input tokens per request (mocker 2000, else 256)")
    p.add_argument("--osl", type=int, help="output tokens per request (mocker 32, else 16)")
    args = p.parse_args(argv)
    fill_defaults(args, DEFAULTS["mocker" if args.engine == "mocker" else "real"])
    if not 0 < args.ratio < 1:
        p.error(f"--ratio must be in (0, 1), got {args.ratio:g}")
    if args.rounds < 1 or args.requests < 1:
        p.error("--rounds and --requests must be at least 1")
    return args


def trace_vs_client(records: list[Record], spans: list[Span]) -> dict:
    """Per request aiperf measured: its trace's arrival-to-first-token time against aiperf's TTFT."""
    roots = {s.attributes["http.request.header.x-request-id"][0]: s for s in spans
             if s.name == "request" and "http.request.header.x-request-id" in s.attributes}
    # the first_token span ends as the response took the token (a streamed chunk sent): the client's TTFT
    firsts = {(s.trace_id, s.parent_span_id): s.end_ns for s in spans if s.name == "first_token"}
    errors, sent = [], []  # against the client's TTFT; against it less the connection's opening
    for r in records:
        root = roots.get(r.request_id)
        first = root and firsts.get((root.trace_id, root.span_id))
        if r.ttft_ms and first:
            traced = (first - root.start_ns) / 1e6
            errors.append(traced / r.ttft_ms - 1)
            sent.append(traced / (r.ttft_ms - r.connect_ms) - 1)
    if not errors:
        return {"requests": len(records), "matched": 0}
    return {"requests": len(records), "matched": len(errors), "median_error": statistics.median(errors),
            "worst_error": max(errors, key=abs), "within_5pct": sum(abs(e) <= 0.05 for e in errors) / len(errors),
            "median_error_sent": statistics.median(sent),
            "within_5pct_sent": sum(abs(e) <= 0.05 for e in sent) / len(sent)}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    slo = Slo(ttft_ms=1e6, itl_ms=1e6)  # goodput is not what this measures
    configs = [OFF, f"sampled {args.ratio:g}", ALL]
    session = Session("tracing_overhead", args, slo, argv=argv, runs=len(configs) * args.rounds)
    engine = worker_args(args, []) + (("--kv-cache-memory-gb", "54") if args.engine == "mocker" else ())
    workload = Workload("synthetic", ["--synthetic-input-tokens-mean", str(args.isl),
                                      "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean",
                                      str(args.osl), "--output-tokens-stddev", "0"],
                        requests=args.requests, rate=args.rate)
    checks: list[dict] = []
    exported: dict[str, int] = {}
    for r in range(args.rounds):
        for config in configs[r % len(configs):] + configs[:r % len(configs)]:
            with OtlpReceiver() as receiver:
                ratio = {OFF: None, ALL: 1.0}.get(config, args.ratio)
                tracing = () if ratio is None else ("--otlp-endpoint", receiver.endpoint,
                                                    "--trace-sample-ratio", f"{ratio:g}")
                d = deploy.Deployment(config, args.engine, prefill=1, decode=1, worker_args=(*engine, *tracing))
                group = f"round {r + 1}"
                with deploy.running(d, session.out / "logs" / f"{config}_{r + 1}".replace(" ", "_")) as url:
                    session.measure(url, config, group, None, workload, seed=args.seed + r)
                spans = list(receiver.spans)  # serve has stopped: every process flushed what it held
            exported[config] = exported.get(config, 0) + sum(s.name == "request" for s in spans)
            if config == ALL:
                checks.append(trace_vs_client(session.records[(config, group)], spans))
    by = {c: [s for s in session.summaries if s.config == c] for c in configs}
    p50 = {c: statistics.median(s.ttft_ms[50] for s in runs) for c, runs in by.items()}
    itl = {c: statistics.median(s.itl_ms[50] for s in runs) for c, runs in by.items()}
    sent = {c: sum(s.ok + s.failed for s in runs) for c, runs in by.items()}
    rows = ["| tracing | runs | TTFT p50 ms (median of runs) | vs off | ITL p50 ms | vs off | request spans "
            "exported / requests |", "|---|---|---|---|---|---|---|"]
    for c in configs:
        rows.append(f"| {c} | {len(by[c])} | {p50[c]:.1f} | {p50[c] / p50[OFF] - 1:+.1%} | {itl[c]:.2f} | "
                    f"{itl[c] / itl[OFF] - 1:+.1%} | {exported.get(c, 0)} / {sent[c]} |")
    matched = [c for c in checks if c["matched"]]
    share = lambda key: (sum(c[key] * c["matched"] for c in matched)  # noqa: E731
                         / max(1, sum(c["matched"] for c in matched)))
    trace_md = (f"Every request traced: {sum(c['matched'] for c in checks)} of {sum(c['requests'] for c in checks)} "
                f"requests found by their X-Request-ID; the trace's arrival-to-first-token time is within 5% of "
                f"aiperf's TTFT for {share('within_5pct'):.1%} of them (median error "
                f"{statistics.median(c['median_error'] for c in matched):+.2%}, worst "
                f"{max((c['worst_error'] for c in matched), key=abs):+.2%}), and of aiperf's TTFT less its "
                f"connection's opening (before the request reached the server) for {share('within_5pct_sent'):.1%} "
                f"(median error {statistics.median(c['median_error_sent'] for c in matched):+.2%})." if matched
                else "Every request traced: no request's trace was found by its X-Request-ID.")
    overhead = p50[configs[1]] / p50[OFF] - 1
    summary_md = ("## Tracing overhead\n\n" + "\n".join(rows) + f"\n\nSampling {args.ratio:g}: TTFT p50 "
                  f"{overhead:+.1%} against off (aim: at most +2%). {trace_md}\n")
    engine_note = (f"mocker (a simulated 8B model on an H100, --speedup {session.speedup:g})" if args.engine == "mocker"
                   else f"{args.engine}, each worker pinned to its own cores")
    note = (f"1 prefill + 1 decode worker, {engine_note}; {args.requests} requests per run at {args.rate:g} req/s, "
            f"{args.isl} input / {args.osl} output tokens; {args.rounds} rounds, each configuration started afresh "
            f"per run, the order rotated each round. Spans exported over OTLP/HTTP (protobuf) to a receiver in "
            f"the benchmark's process.")
    report.write(session.out, "What tracing costs", note, session.provenance, session.summaries, session.ttfts,
                 {"ttft_p50_ms": p50, "itl_p50_ms": itl, "overhead": overhead, "trace_vs_client": checks,
                  "exported": exported, "tracing_md": summary_md})
    report.plot_ttft_cdf(session.out / "ttft_cdf.png", session.ttfts,
                         list(dict.fromkeys(s.group for s in session.summaries)))
    print(f"{summary_md}\nwrote {session.out}/table.md, summaries.json, ttft_cdf.png", flush=True)
    report.exit_if_failed(session.summaries, session.out)


if __name__ == "__main__":
    main()
