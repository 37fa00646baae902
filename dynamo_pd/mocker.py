"""`python -m dynamo_pd.mocker --workers 16 --role aggregated`: many mocker workers in one process.

Each is a whole worker (dynamo_pd.worker: its own RPC server, KV event publisher, KV transfer agent,
load reports and registration) and all share one event loop: mocker engines compute nothing, so a
16-worker deployment runs on one core. Every other flag is a worker's (`--discovery`, `--namespace`,
`--kv-transport`, engine flags such as `--speedup`); `--worker-id NAME` names them NAME-0, NAME-1, ...
`--engine` (default mocker) may name any engine whose registry entry shares a process
(engines.base.EngineEntry.shares_process); `python -m dynamo_pd.serve` starts those here.
`--control` lets the launcher add and drain single workers (the planner's local connector, see _control).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import socket
import sys
from dataclasses import dataclass

from dynamo_pd import tracing
from dynamo_pd.engines.base import EngineRole, engine_entry, engine_names
from dynamo_pd.runtime.tasks import cancel_and_wait
from dynamo_pd.worker import Worker, WorkerConfig, parse_args, start_endpoint
from dynamo_pd.worker_metrics import WorkerEndpoint


@dataclass(frozen=True)
class Options:
    config: WorkerConfig  # every worker's; its worker_id names them <id>-0, <id>-1, ...
    workers: int
    control: bool


def parse(argv: list[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m dynamo_pd.mocker", description="Mocker workers in one process.",
        epilog="Every other flag is a worker's: python -m dynamo_pd.aggregated --help")
    parser.add_argument("--workers", type=int, default=1, help="mocker workers in this process")
    parser.add_argument("--role", default="aggregated", choices=[role.value for role in EngineRole])
    parser.add_argument("--control", action="store_true",
                        help="take `add ID` / `drain ID` commands on stdin, a socket the launcher holds (the "
                             "planner's local connector), and answer each there; --workers may then be 0")
    args, rest = parser.parse_known_args(argv)
    if args.workers < (0 if args.control else 1):
        raise SystemExit(f"error: --workers must be >= {0 if args.control else 1}, got {args.workers}")
    config = parse_args(EngineRole(args.role), ["--engine", "mocker", *rest])
    if not engine_entry(config.engine).shares_process:
        shared = ", ".join(name for name in engine_names() if engine_entry(name).shares_process)
        raise SystemExit(f"error: dynamo_pd.mocker runs workers that share one process ({shared}), "
                         f"not --engine {config.engine}")
    return Options(config, args.workers, args.control)


def named(config: WorkerConfig, worker_id: str) -> WorkerConfig:
    """One worker's config: its own id, and its own engine options (a worker adds to them as it starts)."""
    return dataclasses.replace(config, worker_id=worker_id, engine_config=dataclasses.replace(
        config.engine_config, extra=dict(config.engine_config.extra)))


async def serve(options: Options) -> None:
    config = options.config
    endpoint = await start_endpoint(config)  # one for the process, each series labelled by its worker
    tracing.setup(config.tracing, f"dynamo-pd-{config.engine_config.role.value}", config.worker_id)
    workers = [Worker(named(config, f"{config.worker_id}-{i}" if config.worker_id else ""), endpoint)
               for i in range(options.workers)]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    control = None
    try:
        started = await asyncio.gather(*(worker.start() for worker in workers), return_exceptions=True)
        failed = next((result for result in started if isinstance(result, BaseException)), None)
        if failed is not None:
            raise failed
        print(f"dynamo-pd {len(workers)} {config.engine} {config.engine_config.role.value} workers ready "
              f"(metrics {endpoint.url}/metrics)", flush=True)
        if options.control:
            control = asyncio.create_task(_control(config, endpoint, workers, stop))
        await stop.wait()
    finally:
        if control is not None:
            await cancel_and_wait([control])
        await asyncio.gather(*(worker.stop() for worker in workers))
        await endpoint.close()
        tracing.shutdown()  # what is still queued is exported


async def _control(config: WorkerConfig, endpoint: WorkerEndpoint, workers: list[Worker], stop: asyncio.Event
                   ) -> None:
    """The launcher's commands, a line each on stdin (a socket): `add ID` starts worker ID and answers
    `ready ID` once it registered (`failed ID why` if it cannot start); `drain ID` drains it (Worker.drain:
    out of discovery, its requests finish or move) and answers `stopped ID` once it stopped. The end of
    stdin (the launcher is gone) stops the process."""
    reader, writer = await asyncio.open_unix_connection(sock=socket.socket(fileno=sys.stdin.fileno()))
    tasks: set[asyncio.Task] = set()

    def answer(line: str) -> None:
        writer.write((" ".join(line.split()) + "\n").encode())  # one line, whatever an error's text holds

    def remove(worker: Worker) -> None:
        workers.remove(worker)
        endpoint.workers.remove(worker)  # /ready and /metrics speak of the workers serving here

    async def add(worker_id: str) -> None:
        worker = Worker(named(config, worker_id), endpoint)
        workers.append(worker)
        try:
            await worker.start()
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - said to the launcher, which decides
            remove(worker)
            await worker.stop()
            answer(f"failed {worker_id} {exc}")
            return
        answer(f"ready {worker_id}")

    async def drain(worker_id: str) -> None:
        worker = next((w for w in workers if w.worker_id == worker_id), None)
        if worker is None:
            answer(f"failed {worker_id} no such worker")
            return
        await worker.drain()
        remove(worker)
        await worker.stop()
        answer(f"stopped {worker_id}")

    try:
        while line := await reader.readline():
            verb, _, worker_id = line.decode().strip().partition(" ")
            if verb not in ("add", "drain") or not worker_id:
                answer(f"failed {worker_id or '-'} unknown command {line.decode().strip()!r}")
                continue
            task = asyncio.create_task((add if verb == "add" else drain)(worker_id))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        stop.set()
    finally:
        await cancel_and_wait(list(tasks))
        writer.close()


def main(argv: list[str] | None = None) -> None:
    import uvloop

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    uvloop.run(serve(parse(argv)))


if __name__ == "__main__":
    main()
