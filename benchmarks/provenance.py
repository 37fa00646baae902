"""Where a benchmark's figures came from: the command, the commit (and whether the tree differed from
it), the host's CPU and its vector ISA level, the date. Every benchmark records this with its results."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the flags that decide which kernels run (oneDNN, the native engine's C kernels), most capable first
ISA_LEVELS = (("amx", "amx_tile"), ("avx512", "avx512f"), ("avx2", "avx2"))
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


@dataclass(frozen=True)
class Provenance:
    argv: list[str]  # the command as run from the repository root
    commit: str  # HEAD, or "unknown" outside a git checkout
    dirty: bool  # tracked files differed from `commit` when the run started
    cpu: str  # /proc/cpuinfo's model name
    isa: str  # amx, avx512, avx2 or baseline (unknown without /proc/cpuinfo)
    isa_flags: list[str]  # which of ISA_FLAGS the CPU has
    cpus: int  # cores this process may run on
    date: str  # UTC, ISO 8601, when the run started

    def markdown(self) -> str:
        state = "dirty tree" if self.dirty else "clean tree"
        return (f"Command: `{shlex.join(self.argv)}`; commit {self.commit} ({state}); host: {self.cpu} "
                f"({self.isa}; flags: {' '.join(self.isa_flags) or '-'}), {self.cpus} CPUs; "
                f"{self.date}.")


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30,
                              check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _cpu(cpuinfo: Path) -> tuple[str, str, list[str]]:
    try:
        text = cpuinfo.read_text()
    except OSError:
        return platform.processor() or platform.machine(), "unknown", []
    # every CPU's block names the same model and flags: the last one's win
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}
    flags = set(fields.get("flags", "").split())
    level = next((name for name, flag in ISA_LEVELS if flag in flags), "baseline")
    return fields.get("model name", platform.machine()), level, [f for f in ISA_FLAGS if f in flags]


def collect(program: str, args: Sequence[str], cpuinfo: Path = Path("/proc/cpuinfo")) -> Provenance:
    """`program` is how the benchmark starts from the repository root ("python -m benchmarks.x" or
    "python benchmarks/x.py"), `args` its arguments."""
    commit = (_git("rev-parse", "HEAD") or "unknown").strip()
    status = _git("status", "--porcelain", "--untracked-files=no")
    cpu, isa, flags = _cpu(cpuinfo)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    dirty = status is None or bool(status.strip())  # no git: nothing says the tree is the commit
    return Provenance([*shlex.split(program), *args], commit, dirty, cpu, isa, flags, cpus, date)
