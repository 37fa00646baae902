"""Both comparisons end to end at a small size on the mocker: real deployments, real aiperf runs,
their tables, JSON and plots."""

import json
import tempfile
from pathlib import Path

import pytest

from benchmarks import agg_vs_disagg, aiperf_run, router_policies

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def aiperf_installed():
    try:
        aiperf_run.find_aiperf()
    except SystemExit as exc:
        pytest.skip(str(exc))


def aiperf_temp_folders() -> set[Path]:
    """What aiperf runs leave in the temp folder (its memory-mapped dataset's folder, ours around it)."""
    tmp = Path(tempfile.gettempdir())
    return {*tmp.glob("aiperf_mmap_*"), *tmp.glob("dynamo-pd-aiperf-*")}


def _check_outputs(out, runs: int, requests: int, pngs: list[str]) -> list[dict]:
    data = json.loads((out / "summaries.json").read_text())
    assert len(data["runs"]) == runs
    for run in data["runs"]:
        assert (run["ok"], run["failed"]) == (requests, 0), run
        assert run["good"] == run["aiperf_good"], run  # our goodput test is aiperf's
        assert run["ttft_ms"]["50"] > 0 and run["output_tok_s"] > 0
    table = (out / "table.md").read_text()
    assert all(f"| {run['config']} | {run['group']} |" in table for run in data["runs"])
    for name in pngs:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return data["runs"]


def test_agg_vs_disagg_quick(tmp_path, capsys):
    left = aiperf_temp_folders()
    agg_vs_disagg.main(["--quick", "--workers", "2", "--rates", "4,8", "--requests", "8", "--isl", "600",
                        "--osl", "16", "--speedup", "1", "--out", str(tmp_path)])
    runs = _check_outputs(tmp_path, runs=4, requests=8, pngs=["ttft_cdf.png", "vs_load.png"])
    assert {run["config"] for run in runs} == {"2 aggregated", "1P1D"}
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert [line.split("]")[0] for line in progress] == ["[1/4", "[2/4", "[3/4", "[4/4"]
    assert aiperf_temp_folders() <= left, "an aiperf run left a folder in the temp folder"


def test_router_policies_quick(tmp_path):
    router_policies.main(["--quick", "--workers", "2", "--policies", "kv,round_robin", "--workloads",
                          "shared-prefix", "--requests", "12", "--rate", "2", "--prefixes", "2", "--speedup", "1", "--out",
                          str(tmp_path)])
    runs = _check_outputs(tmp_path, runs=2, requests=12, pngs=["ttft_cdf.png", "kv_hit_rate.png"])
    hit = {run["config"]: run["kv_hit_rate"] for run in runs}
    # 12 requests over 2 prefixes of 4096 tokens, 2 a second: all but the first of each prefix can hit
    assert hit["kv"] > 0.5, hit
