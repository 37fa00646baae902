"""What both comparisons share: their common flags, and one measured run (aiperf against a running
deployment -> a Summary, with a progress line)."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import aiperf_run, deploy
from benchmarks.aiperf_run import Record, Slo, Workload
from benchmarks.provenance import Provenance, collect
from benchmarks.report import Summary, progress_line, summarize
from dynamo_pd.frontend.health import HealthConfig
from dynamo_pd.model_store import DEFAULT_MODEL, resolve_model


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", default="mocker", help="mocker (simulated GPUs) or a real engine: native, vllm")
    p.add_argument("--out", type=Path, default=None, help="output folder (default benchmarks/out/<command>-<time>)")
    p.add_argument("--aiperf", default=None, help="the aiperf command (default $DYNAMO_PD_AIPERF, "
                                                   ".venv-aiperf/bin/aiperf, or aiperf on PATH)")
    p.add_argument("--seed", type=int, default=0, help="aiperf's --random-seed: the same for every configuration")
    p.add_argument("--speedup", type=float, default=None,
                   help="mocker only: simulated time runs this much faster than real time; load is sent that much "
                        "faster and every time measured is scaled back (figures are in simulated time). The "
                        "frontend's own overhead is scaled too, so keep the real load well under its capacity")
    p.add_argument("--max-run-s", type=float, default=300.0, help="aiperf's --benchmark-duration of each run (real s)")
    p.add_argument("--quick", action="store_true", help="a small sweep that finishes in a few minutes")


def fill_defaults(args: argparse.Namespace, defaults: dict) -> None:
    """Each flag left unset takes its default; under --quick, its `quick_<flag>` one where there is one."""
    for key, value in defaults.items():
        if key.startswith("quick_") or getattr(args, key) is not None:
            continue
        quick = defaults.get(f"quick_{key}")
        setattr(args, key, quick if args.quick and quick is not None else value)


def worker_args(args: argparse.Namespace, mocker_args: list[str]) -> tuple[str, ...]:
    if args.engine == "mocker":
        # serve passes the health-check flags to the frontend: its canaries keep their simulated period and
        # bound (on a slowed clock a real 10 s bound fails a busy worker's canary: every worker left routing)
        health = HealthConfig()
        return (*mocker_args, "--speedup", f"{args.speedup:g}",
                "--health-check-interval-s", f"{health.interval_s / args.speedup:g}",
                "--health-check-timeout-s", f"{health.timeout_s / args.speedup:g}")
    if args.speedup not in (None, 1.0):
        raise SystemExit("error: --speedup applies to --engine mocker only")
    return ()


@dataclass
class Session:
    command: str
    args: argparse.Namespace
    slo: Slo
    runs: int  # how many runs in all, for the progress lines
    argv: list[str]  # the command's arguments, recorded with its results
    aiperf: str = ""
    out: Path = Path()
    done: int = 0
    summaries: list[Summary] = field(default_factory=list)
    provenance: Provenance = field(init=False)  # collected as the session starts
    ttfts: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    records: dict[tuple[str, str], list[Record]] = field(default_factory=dict)  # each run's requests

    def __post_init__(self) -> None:
        deploy.stop_on_sigterm()
        self.provenance = collect(f"python -m benchmarks.{self.command}", self.argv)
        self.aiperf = aiperf_run.find_aiperf(self.args.aiperf)
        self.out = self.args.out or Path("benchmarks/out") / f"{self.command}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.out.mkdir(parents=True, exist_ok=True)
        self.hf_cache = self.out / "hf-cache"
        self.tokenizer = aiperf_run.tokenizer_repo(resolve_model(None), self.hf_cache)
        self.speedup = self.args.speedup if self.args.engine == "mocker" else 1.0
        print(f"{self.command}: {self.runs} runs, output in {self.out}", flush=True)

    def measure(self, url: str, config: str, group: str, x: float | None, workload: Workload, seed: int) -> Summary:
        started = time.monotonic()
        artifacts = self.out / "aiperf" / f"{config}_{group}".replace(" ", "_").replace("/", "-")
        cmd = aiperf_run.command(self.aiperf, url, DEFAULT_MODEL, self.tokenizer, workload, self.slo, self.speedup,
                                 seed, artifacts, self.args.max_run_s)
        aiperf_run.run(cmd, artifacts, self.args.max_run_s + 120, self.hf_cache)
        result = aiperf_run.read(artifacts, self.speedup)
        summary = summarize(config, group, x, result, self.slo)
        self.done += 1
        self.summaries.append(summary)
        self.ttfts[(config, group)] = sorted(r.ttft_ms for r in result.records if r.ttft_ms is not None)
        self.records[(config, group)] = result.records
        print(progress_line(self.done, self.runs, summary, time.monotonic() - started), flush=True)
        return summary
