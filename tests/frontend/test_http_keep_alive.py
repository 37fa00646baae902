"""The frontend keeps an idle HTTP connection open longer than clients pool theirs, so a client's next
request on a pooled connection never races the server closing it (uvicorn's default 5 s lost aiperf
requests sent on a connection idle for about that long)."""

import signal
import socket
import subprocess
import sys
import time

from dynamo_pd.runtime.ports import free_port

REQUEST = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
IDLE_S = 8.0  # past uvicorn's default keep-alive (5 s) with room for a loaded host's late timer


def read_response(sock: socket.socket) -> bytes:
    """One HTTP/1.1 response with a Content-Length body, or b"" when the server closed the connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            return b""
        body += chunk
    return head


def test_idle_connection_outlives_client_pools(tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "dynamo_pd.frontend", "--port", str(port), "--discovery",
           f"tcp://127.0.0.1:{free_port()}"]
    with (tmp_path / "frontend.log").open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:  # until it listens (a process starting: nothing to wait on but the port)
            assert proc.poll() is None, (tmp_path / "frontend.log").read_text()
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline, "the frontend did not listen within 60 s"
                time.sleep(0.1)
        with sock:
            sock.sendall(REQUEST)
            assert read_response(sock).startswith(b"HTTP/1.1 200"), "first request"
            sock.settimeout(IDLE_S)  # the server closing the idle connection would end this wait early
            try:
                closed = sock.recv(1) == b""
            except TimeoutError:
                closed = False
            assert not closed, f"the frontend closed a connection idle for under {IDLE_S:g} s"
            sock.settimeout(10)
            sock.sendall(REQUEST)  # what a pooled client does next
            assert read_response(sock).startswith(b"HTTP/1.1 200"), "request on the idle connection"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
