"""Aggregated vs disaggregated serving on this machine, same workload, one run.

    python benchmarks/serving_bench.py                       # agg x1, agg x2, 1P1D (pull, push); 32 Mooncake requests
    python benchmarks/serving_bench.py --modes 1p1d --requests 64

Workload: the first N requests of the Mooncake conversation trace (../shared/data), scaled to
this CPU: each 512-token hash block becomes `--block-tokens` deterministic token ids (equal hash
ids -> equal tokens, so the trace's prefix sharing survives), outputs are trace length / 16
capped at `--max-output`. Requests keep their trace order and run `--concurrency` at a time.
Each deployment is started with `python -m dynamo_pd.serve` and stopped with SIGINT.
Prints TTFT and ITL p50/p99, output tokens/s and the KV hit rate per mode, as a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from dynamo_pd.runtime.ports import free_port

TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mooncake_conversation_trace.jsonl"
MODEL = "SmolLM2-135M-Instruct"
MODES = {"agg1": ["--aggregated", "1"], "agg2": ["--aggregated", "2"], "1p1d": ["--prefill", "1", "--decode", "1"],
         "1p1d-push": ["--prefill", "1", "--decode", "1", "--kv-handoff", "push"]}


def workload(n: int, block_tokens: int, max_output: int, vocab: int = 49152) -> list[tuple[list[int], int]]:
    rows = [json.loads(line) for _, line in zip(range(n), TRACE.open())]
    requests = []
    for row in rows:
        prompt = [t for h in row["hash_ids"] for t in random.Random(h).choices(range(100, vocab), k=block_tokens)]
        requests.append((prompt, max(1, min(max_output, row["output_length"] // 16))))
    return requests


def start(mode: str, port: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "dynamo_pd.serve", *MODES[mode], "--port", str(port),
                             "--discovery-port", str(free_port())], stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while b"dynamo-pd ready" not in log.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"{mode} deployment did not start: {log.read_text()[-2000:]}")
        time.sleep(0.5)
    return proc


async def one(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> tuple[float, list[float], int]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start = time.perf_counter()
    stamps: list[float] = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"text":""' not in line:
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return stamps[0] - start, gaps, len(stamps)


async def run_load(url: str, requests: list[tuple[list[int], int]], concurrency: int) -> dict:
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def bounded(prompt, max_tokens):
            async with semaphore:
                return await one(client, prompt, max_tokens)

        await one(client, [1, 2, 3, 4], 2)  # warm-up
        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(p, m) for p, m in requests))
        elapsed = time.perf_counter() - start
        metrics = (await client.get("/metrics")).text
    ttfts = sorted(r[0] for r in results)
    itls = sorted(g for r in results for g in r[1])
    hit = next((float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("dynamo_pd_kv_hit_rate ")), 0)
    q = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))] * 1000  # noqa: E731
    return {"ttft_p50": q(ttfts, 0.5), "ttft_p99": q(ttfts, 0.99), "itl_p50": q(itls, 0.5), "itl_p99": q(itls, 0.99),
            "tok_s": sum(r[2] for r in results) / elapsed, "hit": hit, "mean_ttft": statistics.mean(ttfts) * 1000}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="agg1,agg2,1p1d,1p1d-push", help=f"comma-separated of {', '.join(MODES)}")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per 512-token trace block")
    p.add_argument("--max-output", type=int, default=32)
    args = p.parse_args()
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        p.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    requests = workload(args.requests, args.block_tokens, args.max_output)
    print(f"{len(requests)} requests, mean prompt {statistics.mean(len(r[0]) for r in requests):.0f} tokens, "
          f"mean output {statistics.mean(r[1] for r in requests):.0f} tokens, concurrency {args.concurrency}",
          flush=True)
    rows = {}
    for mode in modes:
        port = free_port()
        log = Path(f"/tmp/dynamo_pd_bench_{mode}.log")
        proc = start(mode, port, log)
        try:
            print(f"running {mode} ...", flush=True)
            rows[mode] = asyncio.run(run_load(f"http://127.0.0.1:{port}", requests, args.concurrency))
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
    print("\n| mode | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | output tok/s | KV hit rate |")
    print("|---|---|---|---|---|---|---|")
    for mode, r in rows.items():
        print(f"| {mode} | {r['ttft_p50']:.0f} | {r['ttft_p99']:.0f} | {r['itl_p50']:.1f} | {r['itl_p99']:.1f} | "
              f"{r['tok_s']:.1f} | {r['hit']:.2f} |")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
