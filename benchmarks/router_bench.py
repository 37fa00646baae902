"""Router benchmark: KV event ingest rate, find_matches latency at scale, memory per resident block.

    python benchmarks/router_bench.py                 # 1M resident blocks, 8 / 64 / 512 workers
    python benchmarks/router_bench.py --resident 100000 --queries 500   # quick look

Workload: every worker holds whole 256-block (4096-token, block size 16) chains, which all begin with
the same 16-block system prompt and are each held by about two workers; queries are held chains cut
at a random block and continued with fresh blocks, so every worker matches the shared prefix and the
chain's holders match further. Ingest replays BlockStored batches of 16 blocks of 256-block requests spread
over 64 workers through the whole path: msgpack decode, re-hash of token_ids (skipped for a worker trusted to
publish the project's hashes), engine-hash map, indexer. Dynamo's Rust RadixTree alongside when importable,
fed the same events, and holding the same chains for find_matches and for hashing a prompt plus find_matches:
    PYTHONPATH=<a scratch venv with ai-dynamo-runtime>/lib/python3.11/site-packages python benchmarks/router_bench.py
"""

from __future__ import annotations

import argparse
import array
import gc
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.provenance import collect  # noqa: E402
from router.events import BlockStored, decode_batch, encode_batch  # noqa: E402
from router.hashing import block_hashes, local_block_hashes, salt_root, sequence_hashes  # noqa: E402
from router.indexer import KvIndexer, _add, _add_py  # noqa: E402
from router.ingest import EventIngestor  # noqa: E402
from router.service import KvRouter, RouterConfig  # noqa: E402

BLOCK = 16
CHAIN = 256
SYSTEM = 16


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class Chain:
    """A held 4096-token chain: its tokens and each system's keys for it (ours: sequence hashes; Dynamo's
    RadixTree: its local block hashes)."""

    def __init__(self, tokens: list[int], dynamo_hash) -> None:
        self.tokens = array.array("I", tokens)  # a quarter of a list's memory, for ~2,000 chains
        self.hashes = block_hashes(tokens, BLOCK)
        self.dynamo = dynamo_hash(tokens, BLOCK) if dynamo_hash else None


def random_tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(50_000) for _ in range(n)]


def chains(n: int, rng: random.Random, dynamo_hash) -> list[Chain]:
    system = random_tokens(SYSTEM * BLOCK, rng)
    return [Chain(system + random_tokens((CHAIN - SYSTEM) * BLOCK, rng), dynamo_hash) for _ in range(n)]


def percentiles(ns: list[int]) -> tuple[float, float]:
    ns = sorted(ns)
    return ns[len(ns) // 2] / 1e3, ns[int(len(ns) * 0.99)] / 1e3


def dynamo_matching():
    """(RadixTree, compute_block_hash_for_seq) of ai-dynamo-runtime, or None where it is not importable."""
    try:
        from dynamo._core import RadixTree, compute_block_hash_for_seq
    except ImportError:
        return None
    return RadixTree, compute_block_hash_for_seq


def dynamo_store(tree, worker: int, chain: Chain, event_id: int) -> None:
    blocks = [{"block_hash": h, "tokens_hash": t} for h, t in zip(chain.hashes, chain.dynamo)]
    tree.apply_event(worker, json.dumps({"event_id": event_id, "data": {"stored": {"parent_hash": None,
                                                                                   "blocks": blocks}}}).encode())


def bench_find_matches(workers: int, resident: int, queries: int, rng: random.Random, pool: list[Chain],
                       dynamo) -> dict:
    """Our KvIndexer and, when importable, Dynamo's RadixTree holding the same chains on the same workers,
    asked the same prompts in turn: find_matches on the prompt's keys, and hashing the prompt's tokens plus
    find_matches (what a route does)."""
    per_worker = max(1, round(resident / (workers * (CHAIN - SYSTEM))))
    gc.collect()
    before = rss_bytes()
    indexer = KvIndexer()
    store_s = 0.0
    placed = [(w, chain) for w in range(workers) for chain in rng.sample(pool, min(per_worker, len(pool)))]
    for w, chain in placed:
        fresh = [int.from_bytes(h.to_bytes(8, "little"), "little") for h in chain.hashes]  # as events make them
        t0 = time.perf_counter()
        indexer.store(w, fresh)
        store_s += time.perf_counter() - t0
    gc.collect()
    mem = indexer.memory()
    rss = rss_bytes() - before
    tree = None
    if dynamo:
        tree = dynamo[0]()
        for i, (w, chain) in enumerate(placed):
            dynamo_store(tree, w, chain, i)
        tree.find_matches(pool[0].dynamo)  # ordered after every event: the tree is whole from here
    t = {k: [] for k in ("wall", "cpu", "as_dict", "route", "dyn", "dyn_route")}
    matched = []
    def prompt() -> list[int]:
        chain = rng.choice(pool)
        cut = rng.randrange(SYSTEM, CHAIN)
        return list(chain.tokens[: cut * BLOCK]) + random_tokens((CHAIN - cut) * BLOCK, rng)

    for _ in range(queries):
        # two prompts: the second measure on the first's prompt would find the index's nodes in the CPU cache
        asked, hashed = prompt(), prompt()
        hashes = block_hashes(asked, BLOCK)
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        result = indexer.find_matches(hashes)
        t["cpu"].append(time.thread_time_ns() - c0)
        t["wall"].append(time.perf_counter_ns() - t0)
        t0 = time.perf_counter_ns()
        ours = result.to_dict()
        t["as_dict"].append(time.perf_counter_ns() - t0 + t["wall"][-1])
        matched.append(len(ours))
        t0 = time.perf_counter_ns()
        indexer.find_matches(block_hashes(hashed, BLOCK))
        t["route"].append(time.perf_counter_ns() - t0)
        if tree is None:
            continue
        keys = dynamo[1](asked, BLOCK)
        t0 = time.perf_counter_ns()
        theirs = tree.find_matches(keys)
        t["dyn"].append(time.perf_counter_ns() - t0)
        t0 = time.perf_counter_ns()
        tree.find_matches(dynamo[1](hashed, BLOCK))
        t["dyn_route"].append(time.perf_counter_ns() - t0)
        # the same question answered the same way, or the comparison means nothing
        assert {w: n for (w, _), n in theirs.scores.items()} == ours, (theirs.scores, ours)
    return dict(
        workers=workers,
        resident=mem.resident_blocks,
        nodes=mem.nodes,
        **{k: percentiles(v) if v else None for k, v in t.items()},
        workers_matched=statistics.mean(matched),
        store_blocks_s=mem.resident_blocks / store_s,
        rss_per_block=rss / mem.resident_blocks,
        approx_per_block=mem.approx_bytes / mem.resident_blocks,
    )


INGEST_WORKERS = 64


def ingest_requests(n_blocks: int, rng: random.Random) -> list[tuple[list[int], list[int], list[int]]]:
    """256-block requests as (tokens, local hashes, sequence hashes)."""
    out = []
    for _ in range(0, n_blocks, CHAIN):
        tokens = [rng.randrange(50_000) for _ in range(CHAIN * BLOCK)]
        local = local_block_hashes(tokens, BLOCK)
        out.append((tokens, local, sequence_hashes(local)))
    return out


def ingest_batches(requests: list, foreign: bool) -> list[tuple[int, int, bytes]]:
    """(worker, seq, batch) of one BlockStored of 16 blocks each, a request's chain on one of 64 workers."""
    out, seqs = [], [0] * INGEST_WORKERS
    for r, (tokens, _, hashes) in enumerate(requests):
        worker = r % INGEST_WORKERS
        names = [h.to_bytes(8, "big") + b"engine" for h in hashes] if foreign else hashes
        for i in range(0, CHAIN, 16):
            parent = names[i - 1] if i else None
            event = BlockStored(names[i : i + 16], parent, tokens[i * BLOCK : (i + 16) * BLOCK], BLOCK)
            out.append((worker, seqs[worker], encode_batch([event])))
            seqs[worker] += 1
    return out


def bench_ingest(requests: list, kind: str) -> dict:
    """kind: "foreign" (vLLM's hashes, re-hashed), "native" (project hashes, re-hashed: not trusted),
    "trusted" (project hashes from a worker registered with kv_project_hashes)."""
    batches = ingest_batches(requests, kind == "foreign")
    ingestor = EventIngestor(KvIndexer(), BLOCK)
    for w in range(INGEST_WORKERS):
        ingestor.trust(w, kind == "trusted")
    gc.collect()
    t0, c0 = time.perf_counter(), time.thread_time()
    for worker, seq, payload in batches:
        ingestor.deliver(worker, seq, payload)
    total, cpu = time.perf_counter() - t0, time.thread_time() - c0
    blocks = ingestor.stats.blocks_stored
    assert blocks == len(requests) * CHAIN and not ingestor.stats.unknown_parent
    return dict(kind=kind, blocks=blocks, blocks_s=blocks / total, cpu_blocks_s=blocks / cpu,
                total_us=total / blocks * 1e6)


def bench_ingest_stages(requests: list) -> tuple[float, float, float]:
    """us per block of decode, re-hash and index, each alone over the foreign batches."""
    payloads = [p for _, _, p in ingest_batches(requests, True)]
    t0 = time.perf_counter()
    events = [decode_batch(p)[0].events[0] for p in payloads]
    decode = time.perf_counter() - t0
    t0 = time.perf_counter()
    project = [sequence_hashes(local_block_hashes(e.token_ids, BLOCK), salt_root(None)) for e in events]
    hashing = time.perf_counter() - t0
    indexer = KvIndexer()
    t0 = time.perf_counter()
    for i, hashes in enumerate(project):
        indexer.store(i // (CHAIN // 16) % INGEST_WORKERS, hashes)
    store = time.perf_counter() - t0
    blocks = len(requests) * CHAIN
    return decode / blocks * 1e6, hashing / blocks * 1e6, store / blocks * 1e6


def bench_dynamo_ingest(requests: list) -> dict | None:
    """Dynamo's Rust RadixTree (ai-dynamo-runtime, when importable) fed the same chains, pre-encoded."""
    dynamo = dynamo_matching()
    if dynamo is None:
        return None
    events = []
    for r, (_, local, hashes) in enumerate(requests):
        for i in range(0, CHAIN, 16):
            blocks = [{"block_hash": h, "tokens_hash": t} for h, t in zip(hashes[i:i + 16], local[i:i + 16])]
            data = {"stored": {"parent_hash": hashes[i - 1] if i else None, "blocks": blocks}}
            events.append((r % INGEST_WORKERS, json.dumps({"event_id": len(events), "data": data}).encode()))
    tree = dynamo[0]()
    gc.collect()
    t0, c0 = time.perf_counter(), time.thread_time()
    for worker, payload in events:
        tree.apply_event(worker, payload)
    tree.find_matches(requests[-1][2])  # ordered after every event: the clock stops once all are applied
    total, cpu = time.perf_counter() - t0, time.thread_time() - c0
    blocks = len(requests) * CHAIN
    return dict(kind="dynamo RadixTree", blocks=blocks, blocks_s=blocks / total, cpu_blocks_s=blocks / cpu,
                total_us=total / blocks * 1e6)


def bench_route(workers: int, rng: random.Random, requests: int = 300) -> tuple[float, float]:
    router = KvRouter(RouterConfig(block_size=BLOCK, seed=0))
    system = [rng.randrange(50_000) for _ in range(256)]
    for w in range(workers):
        router.add_worker(w, "prefill", capacity_blocks=1 << 20)
        router.indexer.store(w, block_hashes(system + [rng.randrange(50_000) for _ in range(1024)], BLOCK))
    times = []
    for i in range(requests):
        prompt = system + [rng.randrange(50_000) for _ in range(CHAIN * BLOCK - len(system))]
        t0 = time.perf_counter_ns()
        router.route("prefill", str(i), prompt)
        times.append(time.perf_counter_ns() - t0)
        router.mark_finished(str(i))
    return percentiles(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--resident", type=int, default=1_000_000, help="resident (worker, block) pairs")
    parser.add_argument("--ingest-only", action="store_true", help="skip find_matches and route")
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--ingest-blocks", type=int, default=200_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(collect("python benchmarks/router_bench.py", sys.argv[1:]).markdown(), flush=True)
    rng = random.Random(args.seed)

    requests = ingest_requests(args.ingest_blocks, rng)
    print(f"event ingest, {len(requests) * CHAIN} blocks: 256-block requests over {INGEST_WORKERS} workers, "
          f"in BlockStored batches of 16 blocks, through the whole path (decode, re-hash unless trusted, index)")
    print("blocks/s by wall clock and by thread CPU time (the RadixTree applies events on its own thread); "
          f"the indexer's store: {'Python (router._index not built)' if _add is _add_py else 'C (router._index)'}")
    print(f"{'engine hashes':<36}{'blocks/s':>12}{'cpu blk/s':>12}{'us/block':>10}{'x dynamo':>10}")
    rows = [bench_ingest(requests, kind) for kind in ("foreign", "native", "trusted")]
    dynamo = bench_dynamo_ingest(requests)
    rows.append(dynamo or dict(kind="dynamo RadixTree: not installed"))
    labels = {"foreign": "vLLM's hashes, re-hashed", "native": "project hashes, re-hashed (untrusted)",
              "trusted": "project hashes, trusted"}
    for r in rows:
        if "blocks_s" not in r:
            print(r["kind"])
            continue
        ratio = f"{r['blocks_s'] / dynamo['blocks_s']:>10.2f}" if dynamo else ""
        print(f"{labels.get(r['kind'], r['kind']):<36}{r['blocks_s']:>12,.0f}{r['cpu_blocks_s']:>12,.0f}"
              f"{r['total_us']:>10.2f}{ratio}")
    decode, hashing, store = bench_ingest_stages(requests)
    print(f"stages alone, us per block (vLLM's hashes): decode {decode:.2f}, re-hash {hashing:.2f}, "
          f"index {store:.2f}")
    if args.ingest_only:
        return

    dynamo = dynamo_matching()
    pool_rng = random.Random(args.seed + 1)  # the same held chains whatever ran before
    pool = chains(max(1, round(args.resident / (CHAIN - SYSTEM) / 2)), pool_rng, dynamo and dynamo[1])
    print(
        f"\nfind_matches, 256-block prompt (4096 tokens), ~{args.resident:,} resident blocks (chains each held by "
        f"~2 workers), {args.queries} queries; p50/p99 in us: wall clock, thread CPU time (no preemption by other "
        f"processes), and wall clock including turning the answer into a dict of every matched worker"
    )
    print(
        f"{'workers':>8}{'resident':>11}{'nodes':>10}{'wall p50/p99':>16}{'cpu p50/p99':>16}"
        f"{'dict p50/p99':>16}{'matched':>9}{'store blk/s':>13}{'B/blk rss':>11}{'B/blk est':>11}"
    )
    results = []
    for workers in args.workers:
        r = bench_find_matches(workers, args.resident, args.queries, rng, pool, dynamo)
        results.append(r)
        cols = "".join(f"{f'{a:.1f}/{b:.1f}':>16}" for a, b in (r["wall"], r["cpu"], r["as_dict"]))
        print(
            f"{r['workers']:>8}{r['resident']:>11,}{r['nodes']:>10,}{cols}{r['workers_matched']:>9.1f}"
            f"{r['store_blocks_s']:>13,.0f}{r['rss_per_block']:>11.0f}{r['approx_per_block']:>11.0f}"
        )
        gc.collect()
    print(
        "\nbeside Dynamo's RadixTree holding the same chains on the same workers, asked the same prompts in turn "
        "(its answer checked equal to ours); wall p50/p99 in us: find_matches on the prompt's keys, and hashing "
        "the prompt's 4096 tokens plus find_matches (ours: block_hashes; Dynamo's: compute_block_hash_for_seq)"
    )
    if not dynamo:
        print("dynamo RadixTree: not installed")
    else:
        print(f"{'workers':>8}{'ours':>14}{'dynamo':>14}{'x dynamo':>10}{'ours hashed':>14}{'dynamo hashed':>15}"
              f"{'x dynamo':>10}")
        for r in results:
            (o, o99), (d, d99), (oh, oh99), (dh, dh99) = r["wall"], r["dyn"], r["route"], r["dyn_route"]
            print(f"{r['workers']:>8}{f'{o:.1f}/{o99:.1f}':>14}{f'{d:.1f}/{d99:.1f}':>14}{d / o:>10.2f}"
                  f"{f'{oh:.1f}/{oh99:.1f}':>14}{f'{dh:.1f}/{dh99:.1f}':>15}{dh / oh:>10.2f}")

    print(
        "\nKvRouter.route end to end (hash the 4096-token prompt, match, load, kv policy), every worker "
        "holding a 256-token shared prefix plus its own 1024 tokens"
    )
    for workers in args.workers:
        p50, p99 = bench_route(workers, rng)
        print(f"{workers:>8} workers: p50 {p50:.0f} us, p99 {p99:.0f} us")

    tokens = [random.randrange(50_000) for _ in range(CHAIN * BLOCK)]
    line = "\nhashing a 4096-token prompt into 256 block keys (once per route), mean of 200: ours (block_hashes) "
    t0 = time.perf_counter()
    for _ in range(200):
        block_hashes(tokens, BLOCK)
    line += f"{(time.perf_counter() - t0) / 200 * 1e6:.0f} us"
    if dynamo:
        t0 = time.perf_counter()
        for _ in range(200):
            dynamo[1](tokens, BLOCK)
        line += f", Dynamo's (compute_block_hash_for_seq) {(time.perf_counter() - t0) / 200 * 1e6:.0f} us"
    print(line)


if __name__ == "__main__":
    main()
