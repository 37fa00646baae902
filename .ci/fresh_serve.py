"""The README's first command as a new user meets it: a brand-new venv holding exactly what
`./dev.sh serve` installs, an empty model cache, free ports; one chat completion, one streamed
completion, `pip check`, then SIGINT and a check that every process it started is gone.

    python3 .ci/fresh_serve.py        (standard library only; exit 0 on success)
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 1500  # install + model fetch + start, on 2 cores
STOP_TIMEOUT_S = 30


def free_ports(count: int) -> list[int]:
    """Distinct free ports: every probe stays bound until all are picked (the kernel may hand a closed
    probe's port to the next probe). Runs before the install, so not dynamo_pd.runtime.ports."""
    probes = [socket.socket() for _ in range(count)]
    try:
        for s in probes:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in probes]
    finally:
        for s in probes:
            s.close()


def post(url: str, body: dict, timeout: float = 180) -> urllib.request.addinfourl:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json"})
    return urllib.request.urlopen(request, timeout=timeout)


def group_members(pgid: int) -> list[int]:
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def check(work: Path) -> str:
    port, discovery_port = free_ports(2)
    env = dict(os.environ, DYNAMO_PD_VENV=str(work / "venv"), DYNAMO_PD_CACHE=str(work / "cache"))
    (work / "cache").mkdir()
    log_path = work / "serve.log"
    start = time.monotonic()
    with open(log_path, "wb") as log:
        serve = subprocess.Popen(["./dev.sh", "serve", "--port", str(port), "--discovery-port", str(discovery_port)],
                                 cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        while True:
            if serve.poll() is not None:
                raise RuntimeError(f"./dev.sh serve exited with {serve.returncode} before answering")
            if time.monotonic() - start > READY_TIMEOUT_S:
                raise RuntimeError(f"not ready within {READY_TIMEOUT_S}s")
            try:  # /ready answers 200 once workers have registered
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5):
                    break
            except OSError:
                time.sleep(2)
        ready_s = time.monotonic() - start
        with urllib.request.urlopen(f"{base}/models", timeout=30) as response:
            model = json.load(response)["data"][0]["id"]
        with post(
            f"{base}/chat/completions",
            {
                "model": model,
                "max_tokens": 16,
                "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
            },
        ) as r:
            chat = json.load(r)["choices"][0]["message"]["content"]
        if not chat.strip():
            raise RuntimeError("the chat completion came back empty")
        pieces, done = [], False
        with post(f"{base}/completions", {"model": model, "prompt": "The capital of France is", "max_tokens": 12,
                                          "temperature": 0, "stream": True}) as r:
            for raw in r:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    pieces.append(json.loads(line[6:])["choices"][0]["text"])
        if not done or len(pieces) < 2 or not "".join(pieces).strip():
            raise RuntimeError(f"the streamed completion was incomplete: {pieces!r} (done={done})")
        pip_check = subprocess.run([str(work / "venv/bin/python"), "-m", "pip", "check", "--disable-pip-version-check"],
                                   capture_output=True, text=True, timeout=120)
        problems = [
            line
            for line in (pip_check.stdout + pip_check.stderr).splitlines()
            if line.strip() and not line.startswith("WARNING: Location") and "No broken requirements" not in line
        ]
        if pip_check.returncode != 0 or problems:
            raise RuntimeError("pip check in the serve venv: " + "; ".join(problems))
    finally:
        os.killpg(serve.pid, signal.SIGINT)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while group_members(serve.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = group_members(serve.pid)
        if left:
            os.killpg(serve.pid, signal.SIGKILL)
        serve.wait(10)
    if left:
        raise RuntimeError(f"{len(left)} processes outlived SIGINT by {STOP_TIMEOUT_S}s")
    return (f"fresh serve: ready {ready_s:.0f}s after ./dev.sh serve started (install + model fetch); "
            f"chat answered {chat.strip()!r}; streamed {len(pieces)} chunks {''.join(pieces)!r}; "
            f"pip check clean; SIGINT stopped every process")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="fresh-serve-") as tmp:
        work = Path(tmp)
        try:
            print(check(work), flush=True)
            return 0
        except Exception as exc:  # noqa: BLE001 - reported with the serve log's tail
            log = (work / "serve.log").read_text(errors="replace") if (work / "serve.log").exists() else ""
            tail = [line for line in log.splitlines() if not line.startswith("WARNING: Location")][-25:]
            print("\n".join(tail), file=sys.stderr)
            print(f"fresh serve: FAILED: {exc}", file=sys.stderr, flush=True)
            return 1


if __name__ == "__main__":
    sys.exit(main())
