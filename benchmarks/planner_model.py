"""The planner's TTFT model against mocker prefill workers at steady rates.

    python -m benchmarks.planner_model                      # 1 prefill worker at 3, 6 and 9 req/s (~8 min)
    python -m benchmarks.planner_model --rates 6,12 --prefill 2

A deployment of --prefill prefill and 2 decode mocker workers (benchmarks.planner's: an 8B model on H100s at
--speedup 0.25) takes Poisson arrivals at each of --rates (simulated req/s) for --duration-s simulated seconds,
--isl / --osl tokens (3000 / 150, the planner benchmark's sinusoid). Its TTFTs past the first fifth (the queue
filling) against dynamo_pd.planner.model at the same rate, over the same duration, its cost per token the mocker
profile's prefill of one prompt. Compared is the wait, each TTFT minus the least measured (the model's: minus a
prompt's prefill): that is what the queueing model must get right, while the prefill and what lies around it (the
KV hand-off, the frontend) is what the planner's offsets learn. Beside it the same model with a step of one whole
prompt, first come first served (M/D/n): what a queue that ignores chunking predicts. All times simulated.
Writes summaries.json and table.md into --out.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from benchmarks import deploy, report, sinusoid
from benchmarks.aiperf_run import Slo, Workload
from benchmarks.router_policies import TRACE_BLOCK_TOKENS
from benchmarks.session import Session, add_common_args, fill_defaults, worker_args
from dynamo_pd.engines.mocker.profile import h100_llama8b
from dynamo_pd.planner.model import Costs, Limits, Load, PoolModel, State

DEFAULTS = dict(rates="3,6,9", quick_rates="6", prefill=1, duration_s=25.0, isl=3000, osl=150,
                kv_cache_memory_gb=54.0, speedup=0.25)
DECODE_WORKERS = 2  # enough that the first token never waits on decode at these rates
CHUNK_TOKENS = 2048  # the workers' --max-num-batched-tokens (dynamo_pd.cli's default)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.planner_model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--rates", help="comma-separated arrival rates, simulated req/s (3,6,9; --quick 6)")
    p.add_argument("--prefill", type=int, help="prefill workers (1)")
    p.add_argument("--duration-s", type=float, help="simulated seconds of arrivals per rate (25)")
    p.add_argument("--isl", type=int, help="input tokens per request (3000)")
    p.add_argument("--osl", type=int, help="output tokens per request (150)")
    p.add_argument("--kv-cache-memory-gb", type=float, help="simulated KV memory per worker (54)")
    args = p.parse_args(argv)
    if args.engine != "mocker":
        p.error("the model check runs mocker workers (--engine mocker)")
    fill_defaults(args, DEFAULTS)
    try:
        args.rates = [float(r) for r in args.rates.split(",")]
    except ValueError:
        p.error(f"--rates: comma-separated numbers, got {args.rates!r}")
    if not all(r > 0 for r in args.rates) or args.prefill < 1 or args.duration_s <= 0:
        p.error("--rates, --prefill and --duration-s must be positive")
    return args


def model_waits(rate: float, args: argparse.Namespace, chunk: int) -> tuple[float, float | None, float | None]:
    """(a prompt's prefill, the model's median and p90 wait: TTFT minus it; None past capacity), simulated s."""
    per_token = h100_llama8b().prefill_time_ms(args.isl, 0) / args.isl / 1e3
    model = PoolModel(Costs(per_token), Load(rate=rate, prompt_tokens=(args.isl,)), State(),
                      Limits(64, 1 << 30, 16, chunk), prefills=True, decodes=False, horizon_s=args.duration_s,
                      attainment=0.9)
    service = per_token * args.isl
    if model.utilization(args.prefill) >= 1:
        return service, None, None
    return service, *(model.ttft_quantile(args.prefill, q) - service for q in (0.5, 0.9))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    session = Session("planner_model", args, Slo(1e9, 1e9), argv=argv, runs=len(args.rates))
    speedup = session.speedup
    mocker = worker_args(args, ["--kv-cache-memory-gb", f"{args.kv_cache_memory_gb:g}"])
    rows = []
    for rate in args.rates:
        found = sinusoid.rows(rate, rate, args.duration_s, 1, args.isl, args.osl, args.seed, TRACE_BLOCK_TOKENS,
                              speedup)
        trace = session.out / f"steady_{rate:g}.jsonl"
        trace.write_text("".join(json.dumps(row) + "\n" for row in found))
        workload = Workload(f"{rate:g} req/s", ["--input-file", str(trace), "--custom-dataset-type",
                                                 "mooncake_trace", "--isl-block-size", str(TRACE_BLOCK_TOKENS)],
                            requests=len(found), trace=trace)
        d = deploy.Deployment(f"{args.prefill}P{DECODE_WORKERS}D", "mocker", prefill=args.prefill,
                              decode=DECODE_WORKERS, worker_args=mocker)
        with deploy.running(d, session.out / "logs" / f"rate_{rate:g}") as url:
            session.measure(url, d.name, workload.name, rate, workload, args.seed)
        records = session.records[(d.name, workload.name)]
        start = min(r.start_ns for r in records) + args.duration_s / speedup * 1e9 / 5  # past the first fifth
        ttfts = np.array([r.ttft_ms for r in records if r.error is None and r.ttft_ms is not None
                          and r.start_ns >= start])
        service, *chunked = model_waits(rate, args, CHUNK_TOKENS)
        _, *whole = model_waits(rate, args, args.isl)
        floor = float(ttfts.min())
        rows.append({"rate": rate, "utilization": rate * service / args.prefill, "requests": len(ttfts),
                     "ttft_min_ms": floor, "ttft_p50_ms": float(np.median(ttfts)),
                     "wait_p50_ms": float(np.median(ttfts)) - floor,
                     "wait_p90_ms": float(np.percentile(ttfts, 90)) - floor,
                     "model_prefill_ms": service * 1e3,
                     **{f"{name}_wait_{q}_ms": None if wait is None else wait * 1e3
                        for name, waits in (("model", chunked), ("whole_prompt", whole))
                        for q, wait in zip(("p50", "p90"), waits)}})
    note = (f"{args.prefill} prefill + {DECODE_WORKERS} decode mocker workers (--speedup {speedup:g}), Poisson "
            f"arrivals for {args.duration_s:g} simulated s a rate, {args.isl} / {args.osl} tokens; all times "
            f"simulated. Wait: TTFT minus the least measured (the model's: minus a prompt's prefill, "
            f"{rows[0]['model_prefill_ms']:.1f} ms). Model: chunked steps of {CHUNK_TOKENS} tokens "
            f"(dynamo_pd.planner.model); whole prompt: the same with a step of one prompt (M/D/n).")
    table = _table(rows)
    report.write(session.out, "The planner's TTFT model against mocker workers", note, session.provenance,
                 session.summaries, session.ttfts, {"model_check": rows, "model_check_md": table})
    print(table, flush=True)
    print(f"wrote {session.out}/table.md, summaries.json", flush=True)
    report.exit_if_failed(session.summaries, session.out)


def _table(rows: list[dict]) -> str:
    def ms(value: float | None) -> str:
        return "inf" if value is None else f"{value:.0f}"

    lines = ["| req/s | utilization | requests | TTFT p50 ms | wait p50 / p90 ms | model wait p50 / p90 | "
             "whole-prompt steps p50 / p90 |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rate']:g} | {r['utilization']:.2f} | {r['requests']} | {ms(r['ttft_p50_ms'])} | "
                     f"{ms(r['wait_p50_ms'])} / {ms(r['wait_p90_ms'])} | {ms(r['model_wait_p50_ms'])} / "
                     f"{ms(r['model_wait_p90_ms'])} | {ms(r['whole_prompt_wait_p50_ms'])} / "
                     f"{ms(r['whole_prompt_wait_p90_ms'])} |")
    return "## Waits, measured and modelled\n\n" + "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
