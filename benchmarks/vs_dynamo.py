"""Our frontend and router beside NVIDIA Dynamo's on the same work, measured by aiperf one after the other.

    python -m benchmarks.vs_dynamo              # 3 rounds, ~10 minutes
    python -m benchmarks.vs_dynamo --quick      # 1 round, fewer requests

Overhead workload: --workers mocker workers whose engines cost almost nothing (each system's own mocker,
sped up --mocker-speedup times), streaming chat of --isl-token prompts and --osl output tokens, --concurrency
requests in flight, --requests requests a run. What differs is the frontend and the router: requests/s, TTFT
percentiles, and the frontend's CPU seconds per 1,000 requests (user + system time of the frontend's
processes, read from /proc before and after the run). Each system with its KV-aware default (ours: `time`,
Dynamo: `--router-mode kv`), rounds in alternating order (run-to-run noise on a shared host is ~10%).

Dynamo runs from its own venv (--dynamo-python, default .venv-dynamo/bin/python; made as issue 34 says:
`ai-dynamo-runtime==1.6.1`, then `ai-dynamo==1.6.1 --no-deps` and its other dependencies):
`python -m dynamo.frontend` and `python -m dynamo.mocker` with file discovery in a folder of the run's own
(DYN_FILE_KV), the TCP request plane and the ZMQ event plane; its mocker reads the model folder of ours
(config.json with `architectures` added). Without that venv only our side runs, and the table says so.
Writes summaries.json and table.md into --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from statistics import mean

import httpx

from benchmarks import deploy, report
from benchmarks.aiperf_run import ROOT, Slo, Workload
from benchmarks.footprint import tree
from benchmarks.session import Session, fill_defaults
from dynamo_pd.model_store import DEFAULT_MODEL, resolve_model
from dynamo_pd.runtime.ports import free_port

DEFAULTS = dict(rounds=3, quick_rounds=1, workers=4, mocker_speedup=200.0, isl=128, osl=16, concurrency=64,
                requests=1200, quick_requests=400)
_READY_TIMEOUT_S = 180.0
_TICKS = os.sysconf("SC_CLK_TCK")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vs_dynamo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="output folder (default benchmarks/out/vs_dynamo-<time>)")
    p.add_argument("--aiperf", default=None, help="the aiperf command (as the other comparisons find it)")
    p.add_argument("--dynamo-python", type=Path, default=ROOT / ".venv-dynamo" / "bin" / "python",
                   help="the Python that has ai-dynamo (default .venv-dynamo/bin/python)")
    p.add_argument("--seed", type=int, default=0, help="aiperf's --random-seed: the same for every run")
    p.add_argument("--max-run-s", type=float, default=300.0, help="aiperf's --benchmark-duration of each run (s)")
    p.add_argument("--quick", action="store_true", help="one round of fewer requests")
    p.add_argument("--rounds", type=int, help="runs of each system, alternating (3; --quick 1)")
    p.add_argument("--workers", type=int, help="mocker workers of each system (4)")
    p.add_argument("--mocker-speedup", type=float, help="each mocker's clock this much faster than real time (200)")
    p.add_argument("--isl", type=int, help="prompt tokens (128)")
    p.add_argument("--osl", type=int, help="output tokens (16)")
    p.add_argument("--concurrency", type=int, help="requests in flight (64)")
    p.add_argument("--requests", type=int, help="requests a run (1200; --quick 400)")
    args = p.parse_args(argv)
    fill_defaults(args, DEFAULTS)
    for flag in ("rounds", "workers", "isl", "osl", "concurrency", "requests"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.mocker_speedup <= 0:
        p.error(f"--mocker-speedup must be > 0, got {args.mocker_speedup}")
    args.engine, args.speedup = "mocker", 1.0  # what Session reads: times measured are real ones
    return args


def cpu_seconds(pids: list[int]) -> float:
    """User + system seconds the processes have used (each /proc/<pid>/stat covers all its threads)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime: the stat's 14th and 15th
    return total / _TICKS


def our_frontends(port: int) -> list[int]:
    """Our frontend processes serving `port` (several with --frontend-processes)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            argv = cmdline.read_bytes().split(b"\0")
            if b"dynamo_pd.frontend" in argv and str(port).encode() in argv:
                found.append(int(cmdline.parent.name))
    return found


def dynamo_model_dir(folder: Path) -> Path:
    """Our model's folder as Dynamo's mocker reads it: its files, config.json with `architectures`."""
    source = resolve_model(None)
    folder.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_file() and f.name != "config.json":
            (folder / f.name).symlink_to(f.resolve())
    config = json.loads((source / "config.json").read_text())
    config.setdefault("architectures", ["LlamaForCausalLM"])
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@contextlib.contextmanager
def dynamo_running(python: Path, workers: int, speedup: float, log_dir: Path) -> Iterator[tuple[str, int]]:
    """Dynamo's frontend (KV router) and mocker: (base URL, the frontend's pid) while they run."""
    log_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dynamo-pd-vs-dynamo-") as tmp:
        model = dynamo_model_dir(Path(tmp) / "model")
        env = {**os.environ, "DYN_FILE_KV": str(Path(tmp) / "discovery"), "DYN_LOG": "warn"}
        planes = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
        port = free_port()
        commands = {
            "mocker": [str(python), "-m", "dynamo.mocker", "--model-path", str(model), "--model-name", DEFAULT_MODEL,
                       "--num-workers", str(workers), "--speedup-ratio", f"{speedup:g}", *planes],
            "frontend": [str(python), "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(port),
                         "--router-mode", "kv", *planes],
        }
        procs = {}
        try:
            for name, cmd in commands.items():
                with (log_dir / f"{name}.log").open("wb") as log:
                    procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                   start_new_session=True)
            url = f"http://127.0.0.1:{port}"
            _wait_for_model(url, procs, log_dir)
            yield url, procs["frontend"].pid
        finally:
            for proc in procs.values():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
            for proc in procs.values():
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def _wait_for_model(url: str, procs: dict[str, subprocess.Popen], log_dir: Path) -> None:
    """Until the frontend lists the model and answers a one-token request (its workers are found)."""
    deadline = time.monotonic() + _READY_TIMEOUT_S
    body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    with httpx.Client(base_url=url, timeout=10) as client:
        while True:
            for name, proc in procs.items():
                if proc.poll() is not None:
                    raise SystemExit(f"error: Dynamo's {name} exited with code {proc.returncode} "
                                     f"(log: {log_dir / f'{name}.log'})")
            with contextlib.suppress(httpx.HTTPError):
                if client.post("/v1/chat/completions", json=body).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise SystemExit(f"error: Dynamo did not answer within {_READY_TIMEOUT_S:.0f}s (logs: {log_dir})")
            time.sleep(1.0)  # another process's start: nothing to wait on


@contextlib.contextmanager
def ours_running(args: argparse.Namespace, log_dir: Path) -> Iterator[tuple[str, int]]:
    d = deploy.Deployment("dynamo-pd", "mocker", aggregated=args.workers, router_policy="time",
                          worker_args=("--speedup", f"{args.mocker_speedup:g}"))
    with deploy.running(d, log_dir) as url:
        yield url, int(url.rsplit(":", 1)[1])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    dynamo = args.dynamo_python.is_file() and subprocess.run(
        [str(args.dynamo_python), "-c", "import dynamo.frontend, dynamo.mocker"], capture_output=True).returncode == 0
    systems = ["dynamo-pd", "Dynamo"] if dynamo else ["dynamo-pd"]
    slo = Slo(ttft_ms=1e9, itl_ms=1e9)  # no goodput bound: this compares cost, not an SLO
    session = Session("vs_dynamo", args, slo, argv=argv, runs=args.rounds * len(systems))
    workload = Workload("overhead", ["--synthetic-input-tokens-mean", str(args.isl), "--synthetic-input-tokens-stddev",
                                     "0", "--output-tokens-mean", str(args.osl), "--output-tokens-stddev", "0"],
                        requests=args.requests, concurrency=args.concurrency)
    cpu: dict[str, list[float]] = {s: [] for s in systems}
    by_system: dict[str, list[report.Summary]] = {s: [] for s in systems}
    for r in range(args.rounds):
        for system in systems if r % 2 == 0 else systems[::-1]:
            log_dir = session.out / "logs" / f"{system}_{r + 1}"
            if system == "Dynamo":
                running = dynamo_running(args.dynamo_python, args.workers, args.mocker_speedup, log_dir)
            else:
                running = ours_running(args, log_dir)
            with running as (url, key):
                pids = [p for pid in ([key] if system == "Dynamo" else our_frontends(key)) for p in tree(pid)]
                before = cpu_seconds(pids)
                summary = session.measure(url, f"{system} #{r + 1}", workload.name, None, workload, args.seed)
                cpu[system].append((cpu_seconds(pids) - before) / max(1, summary.ok) * 1000)
                by_system[system].append(summary)
    rows = ["| system | round | requests/s | TTFT p50 / p90 / p99 ms | frontend CPU s per 1,000 requests | failed |",
            "|---|---|---|---|---|---|"]
    for system in systems:
        for i, (s, c) in enumerate(zip(by_system[system], cpu[system])):
            t = s.ttft_ms
            rows.append(f"| {system} | {i + 1} | {s.request_s:.0f} | {t[50]:.0f} / {t[90]:.0f} / {t[99]:.0f} | "
                        f"{c:.2f} | {s.failed} |")
    note = (f"Overhead workload: {args.workers} mocker workers per system sped up {args.mocker_speedup:g}x, "
            f"streaming chat, {args.isl}-token prompts, {args.osl} output tokens, {args.concurrency} in flight, "
            f"{args.requests} requests a run, {args.rounds} round(s) in alternating order; times are real. "
            + ("" if dynamo else f"Dynamo is not installed at {args.dynamo_python}: our side only."))
    extra = {"cpu_s_per_1000_requests": cpu, "overhead_md": "## Frontend cost\n\n" + "\n".join(rows) + "\n"
             + _ratios(by_system, cpu)}
    report.write(session.out, "dynamo-pd beside NVIDIA Dynamo", note, session.provenance, session.summaries,
                 session.ttfts, extra)
    print(extra["overhead_md"], flush=True)
    print(f"wrote {session.out}/table.md, summaries.json", flush=True)
    report.exit_if_failed(session.summaries, session.out)


def _ratios(by_system: dict[str, list[report.Summary]], cpu: dict[str, list[float]]) -> str:
    """Ours against Dynamo's, the mean over rounds."""
    if "Dynamo" not in by_system:
        return ""
    ours, theirs = by_system["dynamo-pd"], by_system["Dynamo"]
    return (f"\ndynamo-pd / Dynamo (mean of rounds): requests/s "
            f"{mean(s.request_s for s in ours) / mean(s.request_s for s in theirs):.2f}x, TTFT p50 "
            f"{mean(s.ttft_ms[50] for s in ours) / mean(s.ttft_ms[50] for s in theirs):.2f}x, frontend CPU per "
            f"request {mean(cpu['dynamo-pd']) / mean(cpu['Dynamo']):.2f}x (below 1: ours costs less).\n")


if __name__ == "__main__":
    main()
