"""Every benchmark records where its figures came from (argv, commit and whether the tree was dirty, the host
CPU and its ISA level, the date), and a comparison with a failed request says so and fails."""

import datetime
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import aiperf_run, provenance, report
from benchmarks.aiperf_run import Slo

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parent / "data"


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout


def host_isa() -> tuple[str, str]:
    """The model name and ISA level read here straight from /proc/cpuinfo's first CPU."""
    first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first.splitlines())}
    flags = fields["flags"].split()
    level = "amx" if "amx_tile" in flags else "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags \
        else "baseline"
    return fields["model name"], level


def check_fields(recorded: dict, argv: list[str]) -> None:
    assert recorded["argv"] == argv
    assert recorded["commit"] == git("rev-parse", "HEAD").strip()
    assert recorded["dirty"] == bool(git("status", "--porcelain", "--untracked-files=no").strip())
    assert (recorded["cpu"], recorded["isa"]) == host_isa()
    assert recorded["cpus"] >= 1
    age = datetime.datetime.now(datetime.timezone.utc) - datetime.datetime.fromisoformat(recorded["date"])
    assert datetime.timedelta(0) <= age < datetime.timedelta(hours=1), recorded["date"]


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads the host's /proc/cpuinfo")
def test_router_bench_prints_its_provenance():
    """The cheapest benchmark command, run as its docstring says: its first line names where it came from."""
    args = ["--ingest-only", "--ingest-blocks", "512"]
    out = subprocess.run([sys.executable, "benchmarks/router_bench.py", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, check=True).stdout
    first = out.splitlines()[0]
    model, level = host_isa()
    head = git("rev-parse", "HEAD").strip()
    command = f"python benchmarks/router_bench.py {' '.join(args)}"
    assert first.startswith(f"Command: `{command}`; commit {head} ("), first
    assert f"host: {model} ({level}; flags: " in first and first.endswith(".")


def test_router_bench_runs_whole_on_a_small_index():
    """Every table of router_bench (ingest, find_matches, beside Dynamo where importable, route, hashing)."""
    args = ["--ingest-blocks", "512", "--resident", "4000", "--queries", "20", "--workers", "2", "70"]
    out = subprocess.run([sys.executable, "benchmarks/router_bench.py", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["2"], ["70"])]
    assert [r[0] for r in rows[:2]] == ["2", "70"] and all(float(r[-4]) == float(r[0]) for r in rows[:2]), out
    assert "2 workers: p50" in out and "70 workers: p50" in out and "ours (block_hashes)" in out


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads the host's /proc/cpuinfo")
def test_comparison_results_carry_provenance(tmp_path):
    """summaries.json and table.md as both comparisons write them (report.write), of a real aiperf export."""
    argv = ["--engine", "mocker", "--quick"]
    origin = provenance.collect("python -m benchmarks.router_policies", argv)
    summary = report.summarize("kv", "shared-prefix", None, aiperf_run.read(DATA), Slo(250, 15))
    report.write(tmp_path, "t", "n", origin, [summary], {})
    recorded = json.loads((tmp_path / "summaries.json").read_text())["provenance"]
    check_fields(recorded, ["python", "-m", "benchmarks.router_policies", *argv])
    assert origin.markdown() in (tmp_path / "table.md").read_text()


@pytest.mark.parametrize("flags, level", [("fpu sse2 avx avx2 avx512f avx512_bf16 amx_bf16 amx_tile", "amx"),
                                          ("sse2 avx2 avx512f avx512bw", "avx512"),
                                          ("sse2 avx avx2 fma", "avx2"), ("fpu sse2", "baseline")])
def test_isa_level_from_cpuinfo_flags(tmp_path, flags, level):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: Some CPU @ 2.0GHz\nflags\t\t: {flags}\n\n")
    origin = provenance.collect("python benchmarks/x.py", [], cpuinfo)
    assert (origin.cpu, origin.isa) == ("Some CPU @ 2.0GHz", level)
    assert origin.isa_flags == [f for f in provenance.ISA_FLAGS if f in flags.split()]


def test_failed_requests_fail_the_comparison(tmp_path):
    """A run that lost requests is marked FAILED in its table, with aiperf's reason, and the command exits
    non-zero once its results are written."""
    result = aiperf_run.read(DATA)
    lost = "503 Service Unavailable: no workers are registered"
    for r in result.records[4:]:
        r.error = lost
    runs = [report.summarize("kv", "shared-prefix", None, aiperf_run.read(DATA), Slo(250, 15)),
            report.summarize("round_robin", "shared-prefix", None, result, Slo(250, 15))]
    origin = provenance.collect("python -m benchmarks.router_policies", [])
    report.write(tmp_path, "t", "n", origin, runs, {})
    table = (tmp_path / "table.md").read_text()
    assert "| kv | shared-prefix | 6/0 |" in table
    assert "| round_robin | shared-prefix | 4/2 **FAILED** |" in table
    assert f"- round_robin @ shared-prefix: 2 of 6 failed: 2 x {lost}" in table
    assert json.loads((tmp_path / "summaries.json").read_text())["runs"][1]["errors"] == {lost: 2}
    with pytest.raises(SystemExit, match=r"failed in 1 of 2 runs: round_robin @ shared-prefix \(2\)"):
        report.exit_if_failed(runs, tmp_path)
    report.exit_if_failed(runs[:1], tmp_path)  # none failed: returns
