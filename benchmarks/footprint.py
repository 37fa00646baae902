"""What the default deployment costs to start and hold: `python -m dynamo_pd.serve` (1 prefill + 1 decode
native worker and the frontend, SmolLM2-135M), the seconds until /v1/models answers and one chat completion
is answered, then each process's resident memory (VmRSS), read from /proc.

    python benchmarks/footprint.py                      # the default deployment
    python benchmarks/footprint.py -- --aggregated 2    # anything after -- goes to serve

The model cache is the usual one (warm after the first run: the time to ready is then the processes' start).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import deploy  # noqa: E402
from benchmarks.provenance import ROOT, collect  # noqa: E402
from dynamo_pd.runtime.ports import free_port  # noqa: E402

READY_TIMEOUT_S = 600


def tree(pid: int) -> list[int]:
    """`pid` and every process below it."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


def role(pid: int) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    names = [a.decode() for a in argv if a]
    module = names[names.index("-m") + 1] if "-m" in names else " ".join(names[:2])
    worker = names[names.index("--worker-id") + 1] if "--worker-id" in names else ""
    return f"{module} {worker}".strip()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def request(url: str, body: dict | None = None, timeout: float = 120) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as response:
        return json.load(response)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("serve_args", nargs="*", help="arguments for serve (after --)")
    args = p.parse_args(argv)
    provenance = collect("python benchmarks/footprint.py", argv)
    deploy.stop_on_sigterm()
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="footprint-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "dynamo_pd.serve", "--port", str(port), "--discovery-port", str(free_port()),
           *args.serve_args]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        while True:
            if proc.poll() is not None:
                print(f"error: serve exited with {proc.returncode}; its log: {log.name}", file=sys.stderr)
                return 1
            if time.monotonic() - start > READY_TIMEOUT_S:
                print(f"error: serve not ready after {READY_TIMEOUT_S} s; its log: {log.name}", file=sys.stderr)
                return 1
            try:
                model = request(f"{base}/models", timeout=5)["data"][0]["id"]
                break
            except (OSError, KeyError, IndexError, ValueError):
                time.sleep(0.5)
        ready_s = time.monotonic() - start
        answer = request(f"{base}/chat/completions", {"model": model, "max_tokens": 16, "temperature": 0,
                                                     "messages": [{"role": "user", "content": "Hello!"}]})
        answered_s = time.monotonic() - start
        assert answer["choices"][0]["message"]["content"], answer
        rows = [(role(pid), rss_mib(pid)) for pid in tree(proc.pid)]
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    print(f"# Footprint: python -m dynamo_pd.serve {' '.join(args.serve_args)}\n\n{provenance.markdown()}\n")
    print(f"Ready (/v1/models answers) in {ready_s:.1f} s; the first chat answered at {answered_s:.1f} s.\n")
    print("| process | resident MiB |\n|---|---|")
    for name, mib in rows:
        print(f"| `{name}` | {mib:.0f} |")
    print(f"| total | {sum(m for _, m in rows):.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
