"""`python -m dynamo_pd.mocker --workers 16 --role aggregated`: many mocker workers in one process.

Each is a whole worker (dynamo_pd.worker: its own RPC server, KV event publisher, KV transfer agent,
load reports and registration) and all share one event loop: mocker engines compute nothing, so a
16-worker deployment runs on one core. Every other flag is a worker's (`--discovery`, `--namespace`,
`--kv-transport`, engine flags such as `--speedup`); `--worker-id NAME` names them NAME-0, NAME-1, ...
`--engine` (default mocker) may name any engine whose registry entry shares a process
(engines.base.EngineEntry.shares_process); `python -m dynamo_pd.serve` starts those here.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal

from dynamo_pd.engines.base import EngineRole, engine_entry, engine_names
from dynamo_pd.worker import Worker, WorkerConfig, parse_args, start_endpoint


def parse(argv: list[str] | None = None) -> list[WorkerConfig]:
    parser = argparse.ArgumentParser(
        prog="python -m dynamo_pd.mocker", description="Mocker workers in one process.",
        epilog="Every other flag is a worker's: python -m dynamo_pd.aggregated --help")
    parser.add_argument("--workers", type=int, default=1, help="mocker workers in this process")
    parser.add_argument("--role", default="aggregated", choices=[role.value for role in EngineRole])
    args, rest = parser.parse_known_args(argv)
    if args.workers < 1:
        raise SystemExit(f"error: --workers must be >= 1, got {args.workers}")
    config = parse_args(EngineRole(args.role), ["--engine", "mocker", *rest])
    if not engine_entry(config.engine).shares_process:
        shared = ", ".join(name for name in engine_names() if engine_entry(name).shares_process)
        raise SystemExit(f"error: dynamo_pd.mocker runs workers that share one process ({shared}), "
                         f"not --engine {config.engine}")
    return [dataclasses.replace(
        config, worker_id=f"{config.worker_id}-{i}" if config.worker_id else "",
        engine_config=dataclasses.replace(config.engine_config, extra=dict(config.engine_config.extra)),
    ) for i in range(args.workers)]


async def serve(configs: list[WorkerConfig]) -> None:
    endpoint = await start_endpoint(configs[0])  # one for the process, each series labelled by its worker
    workers = [Worker(config, endpoint) for config in configs]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        started = await asyncio.gather(*(worker.start() for worker in workers), return_exceptions=True)
        failed = next((result for result in started if isinstance(result, BaseException)), None)
        if failed is not None:
            raise failed
        role = configs[0].engine_config.role.value
        print(f"dynamo-pd {len(workers)} {configs[0].engine} {role} workers ready "
              f"(metrics {endpoint.url}/metrics)", flush=True)
        await stop.wait()
    finally:
        await asyncio.gather(*(worker.stop() for worker in workers))
        await endpoint.close()


def main(argv: list[str] | None = None) -> None:
    import uvloop

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    uvloop.run(serve(parse(argv)))


if __name__ == "__main__":
    main()
