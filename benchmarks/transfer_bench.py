"""KV transfer throughput between two processes, per transport, next to memcpy of the same bytes.

    python benchmarks/transfer_bench.py [--mib 64] [--iters 10] [--transports nixl,zmq-ipc,zmq-tcp,inproc]

A holder process keeps a SmolLM2-135M-shaped native cache (30 layers, 3 KV heads, head dim 64,
float32, 16-token blocks: 720 KiB a block); this process pulls --mib of blocks into its own cache
of the same layout, once as one contiguous run of block ids and once scattered at random.
Reported per transport: GB/s (median over --iters pulls), its ratio to a plain memcpy (numpy, one
thread) of the same number of bytes measured right next to it, time to first byte (p50 / p99 of a
one-block pull: Begin, the block, Finish) and the CPU time each side spends per pull (its whole
process, every thread: the transport's progress threads too; "inproc" runs both agents in this
process, so its puller column is both sides). torch's multi-threaded copy_ is shown for context.
The native cache is block-major (a block's layers together), so each block is one region whether
the ids are contiguous or scattered; nothing is packed on either side.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time

import msgspec
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.provenance import collect  # noqa: E402
from kv_transfer import KVLayout, KVMemory, KVTransferAgent, TransferConfig, TransferDescriptor  # noqa: E402

LAYERS, HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16


def layout(num_blocks: int) -> KVLayout:
    return KVLayout.for_engine("native", model="SmolLM2-135M", num_layers=LAYERS, num_kv_heads=HEADS,
                               head_dim=HEAD_DIM, block_size=BLOCK, num_blocks=num_blocks, dtype="float32")


def config(kind: str, name: str) -> TransferConfig:
    if kind == "zmq-ipc":
        return TransferConfig("zmq", endpoint=f"ipc://{tempfile.gettempdir()}/kvbench-{name}-{os.getpid()}.sock")
    return TransferConfig({"zmq-tcp": "zmq"}.get(kind, kind))


def _holder(conn, kind: str, num_blocks: int) -> None:
    asyncio.run(_hold_forever(conn, kind, num_blocks))


async def _hold_forever(conn, kind: str, num_blocks: int) -> None:
    memory = KVMemory.allocate(layout(num_blocks))
    memory.buffers[0].normal_()
    async with KVTransferAgent("holder", memory, config(kind, "holder")) as agent:
        conn.send("ready")
        counter = 0
        while True:
            command = await asyncio.to_thread(conn.recv)
            if command is None:
                return
            if command == "cpu":
                conn.send(time.process_time())
                continue
            descs = []
            for block_ids in command:  # hold each list of block ids as its own request
                counter += 1
                descs.append(agent.hold(f"r{counter}", block_ids, len(block_ids) * BLOCK, lambda *a: None))
            conn.send(msgspec.msgpack.encode(descs))


async def measure(kind: str, patterns: dict[str, list[int]], num_blocks: int, iters: int) -> dict:
    holder_memory = None
    if kind == "inproc":
        holder_memory = KVMemory.allocate(layout(num_blocks))
        holder_memory.buffers[0].normal_()
        holder = await KVTransferAgent("holder", holder_memory, config(kind, "holder")).start()
        hold = lambda lists: [holder.hold(f"r{random.random()}", ids, len(ids) * BLOCK, lambda *a: None)  # noqa: E731
                              for ids in lists]
    else:
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        process = ctx.Process(target=_holder, args=(child, kind, num_blocks), daemon=True)
        process.start()
        assert conn.poll(120) and conn.recv() == "ready"

        def hold(lists):
            conn.send(lists)
            return msgspec.msgpack.decode(conn.recv(), type=list[TransferDescriptor])

    def holder_cpu() -> float:
        if kind == "inproc":
            return 0.0  # in this process: counted in the puller's
        conn.send("cpu")
        return conn.recv()

    results = {}
    try:
        async with KVTransferAgent("puller", KVMemory.allocate(layout(num_blocks)), config(kind, "puller")) as agent:
            for name, src in patterns.items():
                dst = list(range(len(src))) if name == "contiguous" else random.sample(range(num_blocks), len(src))
                descs = hold([src] * (iters + 2))
                for desc in descs[:2]:  # the first two fault in pages and connect
                    await agent.pull(desc, dst)
                times = []
                cpu, held_cpu = time.process_time(), holder_cpu()
                for desc in descs[2:]:
                    start = time.perf_counter()
                    await agent.pull(desc, dst)
                    times.append(time.perf_counter() - start)
                cpu, held_cpu = time.process_time() - cpu, holder_cpu() - held_cpu
                results[name] = (statistics.median(times), cpu / iters, held_cpu / iters)
            one = hold([[7]] * (iters + 2))
            ttfb = []
            for i, desc in enumerate(one):
                start = time.perf_counter()
                await agent.pull(desc, [3])
                if i >= 2:
                    ttfb.append(time.perf_counter() - start)
            ttfb.sort()
            results["ttfb"] = (ttfb[len(ttfb) // 2], ttfb[min(len(ttfb) - 1, round(0.99 * (len(ttfb) - 1)))])
    finally:
        if kind == "inproc":
            await holder.close()
        else:
            conn.send(None)
            process.join(10)
    return results


def copy_seconds(nbytes: int, iters: int) -> tuple[float, float]:
    """Median seconds of a plain memcpy (numpy, one thread) and of torch's threaded copy_."""
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    src_np, dst_np = src.numpy(), dst.numpy()
    dst.copy_(src)  # fault pages in
    plain, threaded = [], []
    for _ in range(iters):
        start = time.perf_counter()
        np.copyto(dst_np, src_np)
        plain.append(time.perf_counter() - start)
        start = time.perf_counter()
        dst.copy_(src)
        threaded.append(time.perf_counter() - start)
    return statistics.median(plain), statistics.median(threaded)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64, help="KV bytes per pull, MiB")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--transports", default="nixl,zmq-ipc,zmq-tcp,inproc")
    args = parser.parse_args()
    print(collect("python benchmarks/transfer_bench.py", sys.argv[1:]).markdown(), flush=True)
    block_bytes = layout(1).block_bytes
    count = max(1, round(args.mib * 2**20 / block_bytes))
    num_blocks = count * 3
    patterns = {"contiguous": list(range(count, 2 * count)),
                "scattered": random.Random(0).sample(range(num_blocks), count)}
    nbytes = count * block_bytes
    print(f"{count} blocks of {block_bytes // 1024} KiB = {nbytes / 2**20:.1f} MiB per pull; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'transport':<10} {'pattern':<11} {'GB/s':>7} {'memcpy GB/s':>12} {'ratio':>6} {'TTFB p50/p99 ms':>16} "
          f"{'CPU ms pull/hold':>17} {'torch copy_ GB/s':>17}")
    for kind in args.transports.split(","):
        results = asyncio.run(measure(kind, patterns, num_blocks, args.iters))
        p50, p99 = results["ttfb"]
        for name in patterns:
            plain, threaded = copy_seconds(nbytes, args.iters)  # next to each row: the machine is noisy
            seconds, cpu_pull, cpu_hold = results[name]
            rate, base = nbytes / seconds / 1e9, nbytes / plain / 1e9
            print(f"{kind:<10} {name:<11} {rate:>7.2f} {base:>12.2f} {rate / base:>6.2f} "
                  f"{p50 * 1e3:>7.2f} / {p99 * 1e3:>6.2f} {cpu_pull * 1e3:>8.1f} / {cpu_hold * 1e3:>6.1f} "
                  f"{nbytes / threaded / 1e9:>17.2f}", flush=True)


if __name__ == "__main__":
    main()
