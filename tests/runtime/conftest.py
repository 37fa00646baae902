"""The runtime tests run under uvloop, with helper subprocesses (etcd and NATS come from tests/conftest.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import uvloop


def pytest_asyncio_loop_factories(config, item):
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture(autouse=True)
async def _cancel_when_stuck(request):
    """pytest-timeout's SIGALRM never reaches Python while uvloop waits in epoll, so a test stuck on an
    await would hang the run: at the same limit the loop itself prints every task's stack and cancels them."""
    loop = asyncio.get_running_loop()

    def expire() -> None:
        print(f"\n{request.node.nodeid}: still running after the {limit:.0f}s timeout; cancelling", file=sys.stderr)
        for task in asyncio.all_tasks(loop):
            task.print_stack(file=sys.stderr)
            task.cancel()

    limit = float(request.config.getini("timeout") or 0)
    handle = loop.call_later(limit, expire) if limit else None
    yield
    if handle is not None:
        handle.cancel()


class Procs:
    """Subprocesses running tests/runtime/proc.py ROLE ARGS...; each prints `READY <value>` once set up."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self._env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))

    def start(self, *args: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("proc.py")), *args],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self._env, text=True)
        self.procs.append(proc)
        return proc

    async def ready(self, proc: subprocess.Popen, timeout_s: float = 30.0) -> str:
        """Wait for the `READY <value>` line; return <value>."""
        try:
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), timeout_s)
        except asyncio.TimeoutError:
            proc.kill()
            raise RuntimeError(f"subprocess {proc.args[2:]} not ready within {timeout_s}s") from None
        if not line.startswith("READY"):
            proc.kill()
            raise RuntimeError(f"subprocess {proc.args[2:]} failed: {line}{proc.stderr.read()[-3000:]}")
        return line[len("READY"):].strip()

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(5)
            proc.stdout.close()
            proc.stderr.close()


@pytest.fixture
def procs():
    p = Procs()
    yield p
    p.close()
