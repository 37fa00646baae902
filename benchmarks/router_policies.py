"""Router policies compared on workloads with reuse, measured by aiperf, with the KV hit rate.

    python -m benchmarks.router_policies                    # mocker: 16 aggregated workers, every policy
    python -m benchmarks.router_policies --quick            # fewer requests, a few minutes
    python -m benchmarks.router_policies --engine native --quick   # 2 native workers
    python -m benchmarks.router_policies --policies kv,round_robin --workloads shared-prefix

Policies are the router's own (router.service.PolicyName: a new one is compared automatically).
Each policy gets a fresh deployment (frontend --router-policy P + N aggregated workers) and runs every
workload in turn; workloads share no prompts, so one does not warm the cache for the next:
  shared-prefix  aiperf's prefix pool: --prefixes prompts of --prefix-tokens tokens, each request one of them
                 plus its own question; the pool is larger than one worker's KV cache, so a policy that
                 sends a prefix everywhere keeps evicting it;
  small-prefix   the same with --small-prefixes prompts, a pool that fits one worker's cache: every policy
                 can keep it everywhere, and a cache-aware one must not fall behind the others there;
  multi-turn     chat sessions whose every turn resends the conversation so far (aiperf's multi-turn);
  mooncake       the first --trace-requests rows of the Mooncake conversation trace (benchmarks/data, aiperf's
                 mooncake_trace: equal hash ids -> equal 512-token blocks) at the trace's own timestamps,
                 rows longer than the model's context left out; --trace-scale divides every length for
                 CPU engines.
KV hit rate: prompt tokens the workers served from their KV cache / prompt tokens (the server's usage
counts). Writes summaries.json, table.md, ttft_cdf.png and kv_hit_rate.png into --out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import typing
from pathlib import Path

from benchmarks import deploy, report
from benchmarks.aiperf_run import ROOT, Slo, Workload
from benchmarks.session import Session, add_common_args, fill_defaults, worker_args
from router.service import PolicyName

POLICIES = typing.get_args(PolicyName)
WORKLOADS = ("shared-prefix", "small-prefix", "multi-turn", "mooncake")
TRACE = ROOT / "benchmarks" / "data" / "mooncake_conversation_trace.jsonl"  # its README says where from
CONTEXT_TOKENS = 8192  # SmolLM2's context, which the frontend enforces (the mocker serves its vocabulary)
TRACE_BLOCK_TOKENS = 512

DEFAULTS = {  # a simulated 8B model on H100s with 16 GB of KV each (mocker), or SmolLM2 on this CPU
    # mocker: 4 GB of KV holds 32768 tokens of the 8B model (128 KiB each): 8 prefixes; the pool is 32
    "mocker": dict(workers=16, rate=8.0, requests=256, quick_requests=64, prefixes=32, small_prefixes=4,
                   prefix_tokens=4096, question_tokens=128, osl=64, trace_requests=100, quick_trace_requests=40,
                   trace_scale=1, kv_cache_memory_gb=4.0, speedup=0.5, ttft_slo_ms=300.0, itl_slo_ms=12.0),
    "real": dict(workers=2, rate=0.5, requests=16, quick_requests=8, prefixes=6, small_prefixes=1, prefix_tokens=256,
                 question_tokens=32, osl=8, trace_requests=8, quick_trace_requests=4, trace_scale=32,
                 kv_cache_memory_gb=0.03, speedup=1.0, ttft_slo_ms=3000.0, itl_slo_ms=300.0),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.router_policies", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, of {', '.join(POLICIES)}")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--workers", type=int, help="aggregated workers (mocker 16, else 2)")
    p.add_argument("--rate", type=float, help="requests/s of the shared-prefix and multi-turn workloads")
    p.add_argument("--requests", type=int, help="requests of the shared-prefix and multi-turn workloads")
    p.add_argument("--prefixes", type=int, help="shared-prefix: distinct prefixes in the pool")
    p.add_argument("--small-prefixes", type=int, help="small-prefix: distinct prefixes in its (smaller) pool")
    p.add_argument("--prefix-tokens", type=int, help="shared-prefix: tokens per prefix")
    p.add_argument("--question-tokens", type=int, help="tokens of each request's own part, or of each turn")
    p.add_argument("--osl", type=int, help="output tokens per request (synthetic workloads)")
    p.add_argument("--trace-requests", type=int, help="mooncake: rows of the trace to replay")
    p.add_argument("--trace-scale", type=int, help="mooncake: divide every length by this (1 for the mocker)")
    p.add_argument("--kv-cache-memory-gb", type=float, help="KV memory per worker (mocker: simulated)")
    p.add_argument("--ttft-slo-ms", type=float, help="goodput bound on TTFT")
    p.add_argument("--itl-slo-ms", type=float, help="goodput bound on TPOT (aiperf's per-request inter_token_latency)")
    args = p.parse_args(argv)
    fill_defaults(args, DEFAULTS["mocker" if args.engine == "mocker" else "real"])
    args.policies, args.workloads = args.policies.split(","), args.workloads.split(",")
    for given, known, flag in ((args.policies, POLICIES, "--policies"), (args.workloads, WORKLOADS, "--workloads")):
        if unknown := [g for g in given if g not in known]:
            p.error(f"{flag}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    return args


def trace_file(out: Path, rows: int, scale: int, speedup: float) -> Path:
    """The first `rows` trace rows that fit the context, lengths / scale, timestamps in real ms."""
    kept = []
    with TRACE.open() as f:
        for line in f:
            row = json.loads(line)
            isl, osl = math.ceil(row["input_length"] / scale), max(1, row["output_length"] // scale)
            if isl + osl > CONTEXT_TOKENS - 64:  # room for the chat template
                continue
            kept.append({"timestamp": row["timestamp"] / speedup, "input_length": isl, "output_length": osl,
                         "hash_ids": row["hash_ids"]})
            if len(kept) == rows:
                break
    if len(kept) < rows:
        raise SystemExit(f"error: --trace-requests {rows}: {TRACE} holds only {len(kept)} rows that fit the "
                         f"context at --trace-scale {scale}")
    path = out / "mooncake_trace.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in kept))
    return path


def workloads(args: argparse.Namespace, out: Path, speedup: float) -> dict[str, Workload]:
    synthetic = ["--synthetic-input-tokens-mean", str(args.question_tokens), "--synthetic-input-tokens-stddev", "0",
                 "--output-tokens-mean", str(args.osl), "--output-tokens-stddev", "0"]
    turns = 4
    def prefixed(name: str, prefixes: int) -> Workload:
        return Workload(name, [*synthetic, "--prompt-prefix-pool-size", str(prefixes),
                               "--prompt-prefix-length", str(args.prefix_tokens)],
                        requests=args.requests, rate=args.rate)

    found = {
        "shared-prefix": prefixed("shared-prefix", args.prefixes),
        "small-prefix": prefixed("small-prefix", args.small_prefixes),
        "multi-turn": Workload("multi-turn", [*synthetic, "--conversation-num", str(max(1, args.requests // turns)),
                                              "--conversation-turn-mean", str(turns), "--conversation-turn-stddev", "0",
                                              "--conversation-turn-delay-mean", f"{1000 / speedup:.0f}"],
                               requests=args.requests, rate=args.rate),
    }
    if "mooncake" in args.workloads:
        trace = trace_file(out, args.trace_requests, args.trace_scale, speedup)
        found["mooncake"] = Workload(
            "mooncake", ["--input-file", str(trace), "--custom-dataset-type", "mooncake_trace",
                         "--isl-block-size", str(TRACE_BLOCK_TOKENS // args.trace_scale)],
            requests=args.trace_requests, trace=trace)
    return {name: found[name] for name in args.workloads}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    kv = ["--kv-cache-memory-gb", f"{args.kv_cache_memory_gb:g}"]
    extra = worker_args(args, kv) if args.engine == "mocker" else (*worker_args(args, []), *kv)
    slo = Slo(args.ttft_slo_ms, args.itl_slo_ms)
    session = Session("router_policies", args, slo, argv=argv, runs=len(args.policies) * len(args.workloads))
    loads = workloads(args, session.out, session.speedup)
    for policy in args.policies:
        d = deploy.Deployment(policy, args.engine, aggregated=args.workers, router_policy=policy, worker_args=extra)
        with deploy.running(d, session.out / "logs" / policy) as url:
            for i, (name, workload) in enumerate(loads.items()):
                # the same seed for a workload under every policy; distinct per workload: no shared prompts
                session.measure(url, policy, name, None, workload, seed=args.seed + 1000 * i)
    time_note = (f"simulated time (mocker, --speedup {session.speedup:g}: measured times x {session.speedup:g})"
                 if args.engine == "mocker" else f"real time ({args.engine} engine, each worker pinned to its cores)")
    note = (f"Router policies on {args.workers} aggregated {args.engine} workers ({args.kv_cache_memory_gb:g} GB of KV "
            f"each); all times in {time_note}. shared-prefix: {args.requests} requests at {args.rate:g} req/s, "
            f"{args.prefixes} prefixes x {args.prefix_tokens} tokens (working set {args.prefixes * args.prefix_tokens} "
            f"tokens) + {args.question_tokens}, {args.osl} output tokens; small-prefix: the same with "
            f"{args.small_prefixes} prefixes; multi-turn: {args.requests} requests, 4 turns per session, "
            f"{args.question_tokens} new tokens a turn; mooncake: {args.trace_requests} trace rows, lengths "
            f"/ {args.trace_scale}. Goodput: TTFT <= {slo.ttft_ms:g} ms and TPOT <= {slo.itl_ms:g} ms.")
    report.write(session.out, f"Router policies, {args.workers} workers", note, session.provenance,
                 session.summaries, session.ttfts)
    report.plot_ttft_cdf(session.out / "ttft_cdf.png", session.ttfts, list(loads))
    report.plot_bars(session.out / "kv_hit_rate.png", session.summaries, lambda s: s.kv_hit_rate, "KV hit rate")
    print(f"wrote {session.out}/table.md, summaries.json, ttft_cdf.png, kv_hit_rate.png", flush=True)
    report.exit_if_failed(session.summaries, session.out)


if __name__ == "__main__":
    main()
