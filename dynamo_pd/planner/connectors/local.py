"""The local connector: worker processes on this host, started as `python -m dynamo_pd.serve` starts them.

Each worker of an engine that computes (native, vLLM, ...) is its own process: it grows a pool by starting
one (`Launch.command`) and counting it once it registered in discovery, and shrinks it by SIGTERM, which
drains the worker (it leaves discovery at once, its requests finish or move to another worker within its
--drain-timeout-s) before it exits. Workers of an engine that shares a process (the mocker) live in one
process per pool (`Launch.pool_command`, `python -m dynamo_pd.mocker --control`), which the connector tells
`add ID` and `drain ID` on a socket and which answers `ready ID` (registered), `failed ID why` or
`stopped ID` (drained and stopped).

A pool shrinks from its newest workers. `set_replicas` returns once new workers registered (a worker that
exits or does not register within `ready_timeout_s` is stopped and the call raises ConnectorError: the pool
is as it was) or, shrinking, once the workers left are draining: they stop on their own, and until then
count in `worker_seconds` but not in `replicas`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dynamo_pd.planner.connectors import Connector, ConnectorError
from dynamo_pd.protocol import WorkerInfo
from dynamo_pd.runtime import Discovery, DiscoveryUnavailableError

log = logging.getLogger("dynamo_pd.planner")

_POLL_S = 0.5  # how often a starting worker's registration and a draining process's exit are looked at


@dataclass(frozen=True)
class Launch:
    """How this host's workers start (the launcher's hooks, dynamo_pd.serve)."""

    command: Callable[[str, str], list[str]]  # (pool, worker id) -> a worker process's command line
    pool_command: Callable[[str], list[str]] | None  # (pool) -> its shared process's (--control); None: own
    env: dict[str, str]
    log_dir: Path
    drain_timeout_s: float = 30.0  # the workers' --drain-timeout-s
    ready_timeout_s: float = 600.0


@dataclass
class _Worker:
    worker_id: str
    pool: str
    started: float
    process: subprocess.Popen | None = None  # its own; None: in its pool's shared process
    stopped: float | None = None
    draining: bool = False


@dataclass
class _SharedProcess:
    """One pool's `python -m dynamo_pd.mocker --control` and its command socket."""

    process: subprocess.Popen
    writer: asyncio.StreamWriter
    replies: dict[str, asyncio.Future] = field(default_factory=dict)  # worker id -> its pending answer
    reader_task: asyncio.Task | None = None


class LocalConnector(Connector):
    def __init__(self, launch: Launch, discovery: Discovery, pools: tuple[str, ...],
                 processes: list[subprocess.Popen], clock: Callable[[], float] = time.monotonic) -> None:
        """`processes`: where every process started goes (the launcher stops them all when it stops)."""
        self.launch, self._discovery, self.pools, self._processes = launch, discovery, pools, processes
        self._clock = clock
        self._workers: list[_Worker] = []
        self._shared: dict[str, _SharedProcess] = {}
        self._starting = asyncio.Lock()  # one shared process per pool, however many adds come at once
        self._next = dict.fromkeys(pools, 0)
        self._drains: set[asyncio.Task] = set()

    # ---- the interface

    async def replicas(self) -> dict[str, int]:
        self._reap()
        return {pool: sum(1 for w in self._workers if w.pool == pool and w.stopped is None and not w.draining)
                for pool in self.pools}

    async def set_replicas(self, pool: str, count: int) -> None:
        have = (await self.replicas())[pool]
        if count > have:
            new = [self._new_worker(pool) for _ in range(count - have)]
            results = await asyncio.gather(*(self._start(w) for w in new), return_exceptions=True)
            failed = [str(r) for r in results if isinstance(r, BaseException)]
            if failed:
                raise ConnectorError("; ".join(failed))
        for worker in self._serving(pool)[count:]:
            worker.draining = True
            log.info("draining worker %s (%s)", worker.worker_id, pool)
            task = asyncio.create_task(self._drain(worker))
            self._drains.add(task)
            task.add_done_callback(self._drains.discard)

    def worker_seconds(self) -> dict[str, float]:
        self._reap()
        now = self._clock()
        return {pool: sum((w.stopped or now) - w.started for w in self._workers if w.pool == pool)
                for pool in self.pools}

    async def wait_drained(self) -> None:
        """Until every drain started so far has ended."""
        await asyncio.gather(*self._drains, return_exceptions=True)

    async def close(self) -> None:
        await self.wait_drained()
        for shared in self._shared.values():
            if shared.reader_task is not None:
                shared.reader_task.cancel()
            shared.writer.close()  # the end of its commands: the process stops its workers and exits

    # ---- starting

    def _new_worker(self, pool: str) -> _Worker:
        worker = _Worker(f"{pool}-{self._next[pool]}", pool, self._clock())
        self._next[pool] += 1
        self._workers.append(worker)
        return worker

    def _serving(self, pool: str) -> list[_Worker]:
        """The pool's serving workers, oldest first."""
        return [w for w in self._workers if w.pool == pool and w.stopped is None and not w.draining]

    async def _start(self, worker: _Worker) -> None:
        try:
            if self.launch.pool_command is None:
                await self._start_process(worker)
            else:
                await self._command(worker.pool, "add", worker.worker_id, self.launch.ready_timeout_s)
        except ConnectorError:
            worker.stopped = self._clock()
            raise
        log.info("worker %s (%s) started and registered in %.1f s", worker.worker_id, worker.pool,
                 self._clock() - worker.started)

    async def _start_process(self, worker: _Worker) -> None:
        log_path = self.launch.log_dir / f"{worker.worker_id}.log"
        with open(log_path, "wb") as out:
            worker.process = subprocess.Popen(self.launch.command(worker.pool, worker.worker_id),
                                              env=self.launch.env, stdout=out, stderr=subprocess.STDOUT)
        self._processes.append(worker.process)
        deadline = time.monotonic() + self.launch.ready_timeout_s
        while worker.worker_id not in await self._registered():
            if worker.process.poll() is not None:
                raise ConnectorError(f"worker {worker.worker_id} exited with code "
                                     f"{worker.process.returncode} before it registered (log: {log_path})")
            if time.monotonic() > deadline:
                await asyncio.to_thread(_stop, worker.process, 0.0)
                raise ConnectorError(f"worker {worker.worker_id} did not register within "
                                     f"{self.launch.ready_timeout_s:.0f} s; stopped (log: {log_path})")
            await asyncio.sleep(_POLL_S)

    async def _registered(self) -> set[str]:
        try:
            return {info.worker_id for info in await self._discovery.list(WorkerInfo)}
        except DiscoveryUnavailableError:
            return set()  # not seen yet; the deadline bounds the wait

    # ---- draining

    async def _drain(self, worker: _Worker) -> None:
        try:
            if worker.process is not None:
                worker.process.send_signal(signal.SIGTERM)  # the worker drains, then exits
                await asyncio.to_thread(_stop, worker.process, self.launch.drain_timeout_s + 15)
            else:
                with contextlib.suppress(ConnectorError):  # its process is gone: so is the worker
                    await self._command(worker.pool, "drain", worker.worker_id,
                                        self.launch.drain_timeout_s + 15)
        finally:
            worker.stopped = self._clock()
            log.info("worker %s (%s) drained and stopped after %.1f s", worker.worker_id, worker.pool,
                     worker.stopped - worker.started)

    def _reap(self) -> None:
        """Workers whose process died on its own are gone."""
        for worker in self._workers:
            process = worker.process
            if process is None and worker.pool in self._shared:
                process = self._shared[worker.pool].process
            if worker.stopped is None and process is not None and process.poll() is not None:
                worker.stopped = self._clock()
                log.warning("worker %s (%s) exited with code %s", worker.worker_id, worker.pool,
                            process.returncode)

    # ---- the shared process's commands

    async def _command(self, pool: str, verb: str, worker_id: str, timeout_s: float) -> None:
        async with self._starting:
            shared = self._shared.get(pool)
            if shared is None or shared.process.poll() is not None:
                shared = self._shared[pool] = await self._start_shared(pool)
        answer = shared.replies[worker_id] = asyncio.get_running_loop().create_future()
        try:
            shared.writer.write(f"{verb} {worker_id}\n".encode())
            await shared.writer.drain()
            async with asyncio.timeout(timeout_s):
                reply = await answer
        except (asyncio.TimeoutError, ConnectionError) as exc:
            raise ConnectorError(f"{verb} {worker_id}: no answer from the {pool} process "
                                 f"({exc!r}; log: {self.launch.log_dir / pool}.log)") from None
        finally:
            shared.replies.pop(worker_id, None)
        if reply.startswith("failed"):
            raise ConnectorError(f"{verb} {worker_id}: {reply.split(' ', 2)[-1]} "
                                 f"(log: {self.launch.log_dir / pool}.log)")

    async def _start_shared(self, pool: str) -> _SharedProcess:
        ours, theirs = socket.socketpair()
        with theirs, open(self.launch.log_dir / f"{pool}.log", "ab") as out:
            process = subprocess.Popen(self.launch.pool_command(pool), env=self.launch.env, stdin=theirs,
                                       stdout=out, stderr=subprocess.STDOUT)
        self._processes.append(process)
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        shared = _SharedProcess(process, writer)
        shared.reader_task = asyncio.create_task(self._read_replies(shared, reader))
        return shared

    @staticmethod
    async def _read_replies(shared: _SharedProcess, reader: asyncio.StreamReader) -> None:
        while line := await reader.readline():
            reply = line.decode().strip()
            answer = shared.replies.get(reply.split(" ", 2)[1] if reply.count(" ") else "")
            if answer is not None and not answer.done():
                answer.set_result(reply)
        for answer in shared.replies.values():  # the process is gone: nothing more will come
            if not answer.done():
                answer.set_exception(ConnectionError("the process exited"))


def _stop(process: subprocess.Popen, grace_s: float) -> None:
    """Wait up to grace_s for the process to exit, then kill it."""
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        log.warning("process %d outlived its drain by %.0f s: killed", process.pid, grace_s)
        process.kill()
        process.wait()
