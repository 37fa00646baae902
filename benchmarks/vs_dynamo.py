"""Our frontend and router beside NVIDIA Dynamo's on the same work, measured by aiperf one after the other.

    python -m benchmarks.vs_dynamo                        # every workload, 3 rounds, ~40 minutes
    python -m benchmarks.vs_dynamo --workloads overhead   # ~10 minutes
    python -m benchmarks.vs_dynamo --quick                # 1 round, fewer requests

Overhead workload: --workers mocker workers whose engines cost almost nothing (each system's own mocker,
sped up --mocker-speedup times), streaming chat of --isl-token prompts and --osl output tokens, --concurrency
requests in flight, --requests requests a run. What differs is the frontend and the router: requests/s, TTFT
percentiles, and the frontend's CPU seconds per 1,000 requests (user + system time of the frontend's
processes, read from /proc before and after the run), the part of it its busiest thread used (where a request
waits once that thread is full: one event loop's, or one of Dynamo's runtime threads), and beside it the mocker's
(the frontend's neighbour on the host: a mocker that costs more leaves the frontend less CPU). Each system with
its KV-aware default (ours: `time`, Dynamo: `--router-mode kv`), rounds in alternating order (run-to-run noise on
a shared host is ~10%).

Routing workloads, on one engine timing: --workers mockers per system that time every step from the same
profile (ours, `dynamo_pd.engines.mocker.profile`, Llama-3.1-8B on an H100, real time): our mocker reads it
as JSON with the prefill time of a step's new tokens alone, Dynamo's as the NPZ its `--planner-profile-data`
reads (prefill time by a step's new tokens; decode time by the batch's summed context and mean context,
evaluated from our table); both with 16-token blocks, 1,024 of them a worker, at most 64 sequences and 2,048
batched tokens a step. Each system's KV-aware router and its round-robin (ours: `time`, `round_robin`;
Dynamo: `--router-mode kv`, `round-robin`), and ours with `time` in two frontend processes on one port
(`--frontend-processes 2`: does a router that shares its placements with another route as well as one?), a
fresh deployment each round running:
  prefix    10 prompt prefixes of 4,096 tokens (2.5x one worker's cache), each request one of them and 64
            tokens of its own, 32 output tokens, 300 requests at 10 requests/s;
  mooncake  the first 100 rows of the Mooncake conversation trace that fit the context, at its timestamps.
KV hit rate: prompt tokens served from the KV cache / prompt tokens, as each server's usage reports them.

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
import msgspec
import numpy as np

from benchmarks import deploy, report
from benchmarks.aiperf_run import ROOT, Slo, Workload
from benchmarks.footprint import tree
from benchmarks.router_policies import TRACE_BLOCK_TOKENS, trace_file
from benchmarks.session import Session, fill_defaults
from dynamo_pd.engines.mocker.profile import Profile, h100_llama8b
from dynamo_pd.model_store import DEFAULT_MODEL, resolve_model
from dynamo_pd.runtime.ports import free_port

DEFAULTS = dict(rounds=3, quick_rounds=1, workers=4, mocker_speedup=200.0, isl=128, osl=16, concurrency=64,
                requests=1200, quick_requests=400)
WORKLOADS = ("overhead", "prefix", "mooncake")
# ours: (policy, serve flags); two frontend processes on one port, each routing, sharing placements (issue 34)
OURS = {"time": ("time", ()), "round_robin": ("round_robin", ()),
        "time_2_frontends": ("time", ("--frontend-processes", "2"))}
ROUTERS = {"dynamo-pd": tuple(OURS), "Dynamo": ("kv", "round-robin")}  # each one's KV-aware first, round-robin second
# the routing workloads' engine and load, as issue 34 gives them ((full, --quick) where they differ)
BLOCK_TOKENS, WORKER_BLOCKS, MAX_SEQS, MAX_BATCHED_TOKENS = 16, 1024, 64, 2048
PREFIXES, PREFIX_TOKENS, QUESTION_TOKENS, ROUTING_OSL, RATE = 10, 4096, 64, 32, 10.0
PREFIX_REQUESTS, TRACE_REQUESTS = (300, 100), (100, 40)
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
    p.add_argument("--requests", type=int, help="overhead: requests a run (1200; --quick 400)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    args = p.parse_args(argv)
    fill_defaults(args, DEFAULTS)
    args.workloads = args.workloads.split(",")
    if unknown := [w for w in args.workloads if w not in WORKLOADS]:
        p.error(f"--workloads: unknown {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    for flag in ("rounds", "workers", "isl", "osl", "concurrency", "requests"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.mocker_speedup <= 0:
        p.error(f"--mocker-speedup must be > 0, got {args.mocker_speedup}")
    args.engine, args.speedup = "mocker", 1.0  # what Session reads: times measured are real ones
    return args


def _stat_seconds(stat: Path) -> float:
    """User + system seconds of a /proc stat file (0 when it is gone)."""
    with contextlib.suppress(OSError):
        fields = stat.read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime: the stat's 14th and 15th
    return 0.0


def cpu_seconds(pids: list[int]) -> float:
    """User + system seconds the processes have used (each /proc/<pid>/stat covers all its threads)."""
    return sum(_stat_seconds(Path(f"/proc/{pid}/stat")) for pid in pids)


def thread_seconds(pids: list[int]) -> dict[str, float]:
    """User + system seconds of each thread of the processes, by its /proc path."""
    return {str(stat): _stat_seconds(stat) for pid in pids for stat in Path(f"/proc/{pid}/task").glob("*/stat")}


def busiest_thread(before: dict[str, float], after: dict[str, float]) -> float:
    """The most seconds one thread used between the two readings: an event loop's single thread is where a
    request waits once it is full (docs/benchmarks.md, the frontend's cost)."""
    return max((after[t] - before.get(t, 0.0) for t in after), default=0.0)


def processes(module: str, port: int | None = None) -> list[int]:
    """The processes running `python -m <module>` (with `port` among their arguments, when given)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            argv = cmdline.read_bytes().split(b"\0")
            if module.encode() in argv and (port is None or str(port).encode() in argv):
                found.append(int(cmdline.parent.name))
    return found


def our_frontends(port: int) -> list[int]:
    """Our frontend processes serving `port` (several with --frontend-processes)."""
    return processes("dynamo_pd.frontend", port)


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


def one_timing(folder: Path) -> tuple[Path, Path]:
    """The default profile as both mockers read it: (ours, JSON; Dynamo's, NPZ). A prefill step costs what
    its new tokens cost with nothing cached, as Dynamo's mocker looks a prefill up by its new tokens alone."""
    base = h100_llama8b()
    flat = msgspec.structs.replace(base, name=f"{base.name}, prefill by new tokens",
                                   prefill_ms=[[row[0]] * len(row) for row in base.prefill_ms])
    folder.mkdir(parents=True, exist_ok=True)
    ours, theirs = folder / "profile.json", folder / "profile.npz"
    ours.write_bytes(msgspec.json.encode(flat))
    np.savez(theirs, **dynamo_tables(flat))
    return ours, theirs


def dynamo_tables(profile: Profile) -> dict[str, np.ndarray]:
    """`profile` in the arrays Dynamo's mocker interpolates: prefill ms by a step's new tokens; decode ms on
    a grid of (the batch's summed context, its mean context), whose ratio is the batch. Every product of our
    axes is on the summed-context axis (our table's kinks are grid lines); the mean-context axis adds three
    geometric steps between ours, as a batch varying along it makes the table curve there."""
    ours = [max(1, c) for c in profile.decode_context]
    context = sorted({round(lo * (hi / lo) ** (k / 4)) for lo, hi in zip(ours, ours[1:]) for k in range(4)}
                     | {ours[-1]})
    summed = sorted({0, *(b * c for b in profile.decode_batch for c in context)})
    return {"prefill_isl": np.array(profile.prefill_tokens, dtype=float),
            "prefill_ttft_ms": np.array([row[0] for row in profile.prefill_ms]),
            "decode_active_kv_tokens": np.array(summed, dtype=float),
            "decode_context_length": np.array(context, dtype=float),
            "decode_itl": np.array([[profile.decode_time_ms(a / c, c) for c in context] for a in summed])}


@contextlib.contextmanager
def dynamo_running(python: Path, workers: int, speedup: float, log_dir: Path, router_mode: str = "kv",
                   mocker_args: tuple[str, ...] = ()) -> Iterator[tuple[str, int]]:
    """Dynamo's frontend and mocker: (base URL, the frontend's pid) while they run."""
    log_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dynamo-pd-vs-dynamo-") as tmp:
        model = dynamo_model_dir(Path(tmp) / "model")
        # its mocker's configuration and profile are logged: the run's logs show what timed the steps
        logs = "warn,dynamo_llm::mocker=info,dynamo_mocker::common::perf_model=info"
        env = {**os.environ, "DYN_FILE_KV": str(Path(tmp) / "discovery"), "DYN_LOG": logs}
        planes = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
        port = free_port()
        commands = {
            "mocker": [str(python), "-m", "dynamo.mocker", "--model-path", str(model), "--model-name", DEFAULT_MODEL,
                       "--num-workers", str(workers), "--speedup-ratio", f"{speedup:g}", *mocker_args, *planes],
            "frontend": [str(python), "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(port),
                         "--router-mode", router_mode, *planes],
        }
        procs = {}
        try:
            for name, cmd in commands.items():
                with (log_dir / f"{name}.log").open("wb") as log:
                    procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                   start_new_session=True)
            url = f"http://127.0.0.1:{port}"
            _wait_for_model(url, procs, log_dir)
            if "--planner-profile-data" in mocker_args and b"Loaded performance model" not in (
                    log_dir / "mocker.log").read_bytes():
                raise SystemExit(f"error: Dynamo's mocker did not load the profile (log: {log_dir / 'mocker.log'})")
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
def ours_running(workers: int, log_dir: Path, policy: str, worker_args: tuple[str, ...]) -> Iterator[tuple[str, int]]:
    d = deploy.Deployment("dynamo-pd", "mocker", aggregated=workers, router_policy=policy, worker_args=worker_args)
    with deploy.running(d, log_dir) as url:
        yield url, int(url.rsplit(":", 1)[1])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    dynamo = args.dynamo_python.is_file() and subprocess.run(
        [str(args.dynamo_python), "-c", "import dynamo.frontend, dynamo.mocker"], capture_output=True).returncode == 0
    systems = ["dynamo-pd", "Dynamo"] if dynamo else ["dynamo-pd"]
    routing = [w for w in args.workloads if w != "overhead"]
    runs = args.rounds * (len(systems) * ("overhead" in args.workloads)
                          + sum(len(ROUTERS[s]) for s in systems) * len(routing))
    slo = Slo(ttft_ms=1e9, itl_ms=1e9)  # no goodput bound: this compares cost and routing, not an SLO
    session = Session("vs_dynamo", args, slo, argv=argv, runs=runs)
    extra: dict = {}
    notes = []
    if "overhead" in args.workloads:
        extra.update(overhead(args, session, systems))
        notes.append(f"Overhead workload: {args.workers} mocker workers per system sped up {args.mocker_speedup:g}x, "
                     f"streaming chat, {args.isl}-token prompts, {args.osl} output tokens, {args.concurrency} in "
                     f"flight, {args.requests} requests a run; times are real.")
    if routing:
        extra.update(routing_gain(args, session, systems, routing))
        notes.append(f"Routing workloads ({', '.join(routing)}): {args.workers} mocker workers per system timed by "
                     "one profile (the module's docstring), real time.")
    notes.append(f"{args.rounds} round(s) in alternating order."
                 + ("" if dynamo else f" Dynamo is not installed at {args.dynamo_python}: our side only."))
    report.write(session.out, "dynamo-pd beside NVIDIA Dynamo", " ".join(notes), session.provenance,
                 session.summaries, session.ttfts, extra)
    for key, value in extra.items():
        if key.endswith("_md"):
            print(value, flush=True)
    print(f"wrote {session.out}/table.md, summaries.json", flush=True)
    report.exit_if_failed(session.summaries, session.out)


def overhead(args: argparse.Namespace, session: Session, systems: list[str]) -> dict:
    workload = Workload("overhead", ["--synthetic-input-tokens-mean", str(args.isl), "--synthetic-input-tokens-stddev",
                                     "0", "--output-tokens-mean", str(args.osl), "--output-tokens-stddev", "0"],
                        requests=args.requests, concurrency=args.concurrency)
    cpu: dict[str, list[float]] = {s: [] for s in systems}
    thread_cpu: dict[str, list[float]] = {s: [] for s in systems}  # the frontend's busiest thread's
    engine_cpu: dict[str, list[float]] = {s: [] for s in systems}  # the mockers': the frontend's neighbours
    by_system: dict[str, list[report.Summary]] = {s: [] for s in systems}
    for r in range(args.rounds):
        for system in systems if r % 2 == 0 else systems[::-1]:
            log_dir = session.out / "logs" / f"{system}_{r + 1}"
            if system == "Dynamo":
                running = dynamo_running(args.dynamo_python, args.workers, args.mocker_speedup, log_dir)
            else:
                running = ours_running(args.workers, log_dir, "time", ("--speedup", f"{args.mocker_speedup:g}"))
            with running as (url, key):
                pids = [p for pid in ([key] if system == "Dynamo" else our_frontends(key)) for p in tree(pid)]
                engines = [p for pid in processes("dynamo.mocker" if system == "Dynamo" else "dynamo_pd.mocker")
                           for p in tree(pid)]
                before, engine_before, threads = cpu_seconds(pids), cpu_seconds(engines), thread_seconds(pids)
                summary = session.measure(url, f"{system} #{r + 1}", workload.name, None, workload, args.seed)
                cpu[system].append((cpu_seconds(pids) - before) / max(1, summary.ok) * 1000)
                busiest = busiest_thread(threads, thread_seconds(pids))
                thread_cpu[system].append(busiest / max(1, summary.ok) * 1000)
                engine_cpu[system].append((cpu_seconds(engines) - engine_before) / max(1, summary.ok) * 1000)
                by_system[system].append(summary)
    rows = ["| system | round | requests/s | TTFT p50 / p90 / p99 ms | frontend CPU s per 1,000 requests | "
            "its busiest thread's | mocker CPU s per 1,000 requests | failed |", "|---|---|---|---|---|---|---|---|"]
    for system in systems:
        for i, (s, c, b, e) in enumerate(zip(by_system[system], cpu[system], thread_cpu[system],
                                             engine_cpu[system])):
            t = s.ttft_ms
            rows.append(f"| {system} | {i + 1} | {s.request_s:.0f} | {t[50]:.0f} / {t[90]:.0f} / {t[99]:.0f} | "
                        f"{c:.2f} | {b:.2f} | {e:.2f} | {s.failed} |")
    return {"cpu_s_per_1000_requests": cpu, "busiest_thread_cpu_s_per_1000_requests": thread_cpu,
            "mocker_cpu_s_per_1000_requests": engine_cpu,
            "overhead_md": "## Frontend cost\n\n" + "\n".join(rows) + "\n" + _ratios(by_system, cpu)}


def routing_gain(args: argparse.Namespace, session: Session, systems: list[str], names: list[str]) -> dict:
    quick = int(args.quick)
    ours_profile, theirs_profile = one_timing(session.out / "profile")
    kv_gb = WORKER_BLOCKS * BLOCK_TOKENS * h100_llama8b().kv_bytes_per_token / 2**30
    engine = {"dynamo-pd": ("--profile", str(ours_profile), "--kv-cache-memory-gb", f"{kv_gb:g}", "--block-size",
                            str(BLOCK_TOKENS), "--max-num-seqs", str(MAX_SEQS), "--max-num-batched-tokens",
                            str(MAX_BATCHED_TOKENS)),
              "Dynamo": ("--planner-profile-data", str(theirs_profile), "--num-gpu-blocks-override",
                         str(WORKER_BLOCKS), "--block-size", str(BLOCK_TOKENS), "--max-num-seqs", str(MAX_SEQS),
                         "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS))}
    workloads = {
        "prefix": Workload("prefix", ["--synthetic-input-tokens-mean", str(QUESTION_TOKENS),
                                      "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(ROUTING_OSL),
                                      "--output-tokens-stddev", "0", "--prompt-prefix-pool-size", str(PREFIXES),
                                      "--prompt-prefix-length", str(PREFIX_TOKENS)],
                           requests=PREFIX_REQUESTS[quick], rate=RATE),
    }
    if "mooncake" in names:
        trace = trace_file(session.out, TRACE_REQUESTS[quick], 1, 1.0)
        workloads["mooncake"] = Workload("mooncake", ["--input-file", str(trace), "--custom-dataset-type",
                                                      "mooncake_trace", "--isl-block-size", str(TRACE_BLOCK_TOKENS)],
                                         requests=TRACE_REQUESTS[quick], trace=trace)
    configs = [(system, router) for system in systems for router in ROUTERS[system]]
    runs: dict[tuple[str, str, str], list[report.Summary]] = {}
    shares: dict[str, list[list[float]]] = {}  # workload -> each round's CPU share of each frontend process
    for r in range(args.rounds):
        for system, router in configs if r % 2 == 0 else configs[::-1]:
            log_dir = session.out / "logs" / f"{system}_{router}_{r + 1}"
            if system == "Dynamo":
                running = dynamo_running(args.dynamo_python, args.workers, 1.0, log_dir, router, engine[system])
            else:
                policy, flags = OURS[router]
                running = ours_running(args.workers, log_dir, policy, engine[system] + flags)
            with running as (url, key):
                frontends = our_frontends(key) if system == "dynamo-pd" else []
                for name in names:  # the workloads share no prompts: one does not warm the next
                    before = [cpu_seconds([pid]) for pid in frontends]
                    summary = session.measure(url, f"{system} {router} #{r + 1}", name, None, workloads[name],
                                              args.seed)
                    runs.setdefault((system, router, name), []).append(summary)
                    used = [cpu_seconds([pid]) - b for pid, b in zip(frontends, before)]
                    if len(used) > 1:  # each process's share: both served, or the split measured nothing
                        shares.setdefault(name, []).append([u / max(sum(used), 1e-9) for u in used])
    rows = ["| workload | system | router | TTFT p50 / p90 / p99 ms (each round) | KV hit rate | failed |",
            "|---|---|---|---|---|---|"]
    for name in names:
        for system, router in configs:
            got = runs[(system, router, name)]
            ttft = ", ".join(f"{s.ttft_ms[50]:.0f} / {s.ttft_ms[90]:.0f} / {s.ttft_ms[99]:.0f}" for s in got)
            hits = ", ".join(f"{s.kv_hit_rate:.2f}" for s in got)
            rows.append(f"| {name} | {system} | {router} | {ttft} | {hits} | {sum(s.failed for s in got)} |")
    return {"frontend_cpu_shares": shares,
            "routing_md": "## Routing on one engine timing\n\n" + "\n".join(rows) + "\n"
            + _routing_ratios(runs, names, systems, shares)}


def _routing_ratios(runs: dict[tuple[str, str, str], list[report.Summary]], names: list[str],
                    systems: list[str], shares: dict[str, list[list[float]]]) -> str:
    """Each KV-aware router's gain over its own round-robin, and ours against Dynamo's (means of rounds)."""
    def p90(system: str, router: str, name: str) -> float:
        return mean(s.ttft_ms[90] for s in runs[(system, router, name)])

    lines = []
    for name in names:
        gains = ", ".join(f"{system} {ROUTERS[system][1]} / {ROUTERS[system][0]} "
                          f"{p90(system, ROUTERS[system][1], name) / p90(system, ROUTERS[system][0], name):.2f}x"
                          for system in systems)
        line = f"- {name}: TTFT p90 {gains}"
        if "Dynamo" in systems:
            hit = {s: mean(r.kv_hit_rate for r in runs[(s, ROUTERS[s][0], name)]) for s in systems}
            ratio = p90("dynamo-pd", "time", name) / p90("Dynamo", "kv", name)
            line += (f"; dynamo-pd time / Dynamo kv: TTFT p90 {ratio:.2f}x (below 1: ours lower), "
                     f"KV hit rate {hit['dynamo-pd']:.2f} against {hit['Dynamo']:.2f}")
        two = mean(r.kv_hit_rate for r in runs[("dynamo-pd", "time_2_frontends", name)])
        one = mean(r.kv_hit_rate for r in runs[("dynamo-pd", "time", name)])
        line += (f"; dynamo-pd time with 2 frontend processes: KV hit rate {two:.2f} against one's {one:.2f}, "
                 f"TTFT p90 {p90('dynamo-pd', 'time_2_frontends', name) / p90('dynamo-pd', 'time', name):.2f}x "
                 f"(frontend CPU shares by round: "
                 f"{', '.join(' / '.join(f'{x:.0%}' for x in got) for got in shares.get(name, []))})")
        lines.append(line)
    return "\n" + "\n".join(lines) + "\n"


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
