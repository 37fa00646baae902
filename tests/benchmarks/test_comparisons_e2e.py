"""Both comparisons end to end at a small size on the mocker: real deployments, real aiperf runs,
their tables, JSON and plots."""

import json
import tempfile
from pathlib import Path

import pytest

from benchmarks import agg_vs_disagg, aiperf_run, kv_tiers, router_policies

# aiperf takes 30 s or more to start each run on a 2-core host shared with other work
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


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


def _check_outputs(out, command: str, argv: list[str], runs: int, requests: int,
                   pngs: list[str]) -> list[dict]:
    data = json.loads((out / "summaries.json").read_text())
    # the argv it was given (test_provenance checks the other fields)
    assert data["provenance"]["argv"] == ["python", "-m", f"benchmarks.{command}", *argv]
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
    # one rate: a second is another aiperf run (~30 s) on the same deployment through the same code
    argv = ["--quick", "--workers", "2", "--rates", "4", "--requests", "8", "--isl", "600", "--osl", "16",
            "--speedup", "1", "--out", str(tmp_path)]
    agg_vs_disagg.main(argv)
    runs = _check_outputs(tmp_path, "agg_vs_disagg", argv, runs=2, requests=8,
                          pngs=["ttft_cdf.png", "vs_load.png"])
    assert {run["config"] for run in runs} == {"2 aggregated", "1P1D"}
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert [line.split("]")[0] for line in progress] == ["[1/2", "[2/2"]
    assert aiperf_temp_folders() <= left, "an aiperf run left a folder in the temp folder"


def test_router_policies_quick(tmp_path):
    argv = ["--quick", "--workers", "4", "--policies", "kv,round_robin", "--workloads", "shared-prefix",
            "--requests", "16", "--rate", "1", "--osl", "16", "--prefixes", "4", "--speedup", "1",
            "--out", str(tmp_path)]
    router_policies.main(argv)
    runs = _check_outputs(tmp_path, "router_policies", argv, runs=2, requests=16,
                          pngs=["ttft_cdf.png", "kv_hit_rate.png"])
    hit = {run["config"]: run["kv_hit_rate"] for run in runs}
    # The same 16 requests (one seed) over 4 prefixes of 4096 tokens, all fitting every worker's cache.
    # Round-robin deals them over 4 workers and computes each prefix on every worker it meets (~11 of 16
    # miss, hit rate ~0.3). kv computes each prefix once and sends it back where it is cached (~0.7), unless
    # that worker is busy: its formula then prices the holder's running request like a whole new prefill and
    # goes elsewhere, so the requests are short (16 tokens) and 1 s apart to keep that rare.
    assert hit["kv"] > hit["round_robin"] + 0.2, hit


def test_kv_tiers_quick(tmp_path):
    # 2 workers whose pools hold 2 of the hot workload's 5 prefixes (1,024 tokens) each, as do their host tiers
    argv = ["--workers", "2", "--rounds", "1", "--requests", "12", "--warmup-requests", "8", "--concurrency", "2",
            "--hot-prefixes", "5", "--fits-prefixes", "1", "--prefix-tokens", "1024", "--kv-cache-memory-gb", "0.25",
            "--kv-host-gb", "0.25", "--kv-disk-gb", "1", "--speedup", "1", "--out", str(tmp_path)]
    kv_tiers.main(argv)
    _check_outputs(tmp_path, "kv_tiers", argv, runs=4, requests=12, pngs=["throughput.png", "ttft_cdf.png"])
    data = json.loads((tmp_path / "summaries.json").read_text())
    fetched = {(r["config"], r["workload"]): r["fetched"] for r in data["fetched"]}
    assert sum(fetched["on", "hot"]["tier hits"].values()) > 0, "the host tier served blocks back"
    for workload in ("hot", "fits"):  # off: nothing below the pool, no peer read
        off = fetched["off", workload]
        assert not any(off["tier hits"].values()) and not any(off["peer pulls"].values()), off
    assert set(data["ratios"]) == {"hot", "fits"} and all(r["ratio"] > 0 for r in data["ratios"].values())
    assert (tmp_path / "kv-disk").is_dir() and not any((tmp_path / "kv-disk").iterdir()), \
        "each worker's disk tier removed its folder when it stopped"
