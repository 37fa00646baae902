"""A `python -m dynamo_pd.serve` deployment, scraped: the launcher prints where each process's metrics are and
writes a Prometheus configuration of them; every process renders the metrics docs/operations/metrics.md lists,
with the values the requests sent imply; its KV-transfer rate never exceeds what benchmarks/transfer_bench.py
measures for the same transport; the committed Grafana dashboard asks only for metrics the processes render."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from benchmarks import transfer_bench
from dynamo_pd.runtime.ports import free_port
from kv_transfer.agent import FAILURE_REASONS
from tests.deploy.scrape import dashboard_exprs, get, metric_names, rendered_names, scrape, value, values
from tests.kv_transfer.cases import needs_nixl

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
_READY_S = 600.0
_METRICS_LINE = re.compile(r"dynamo-pd metrics: (.+) at (http://\S+/metrics)$")
_BENCH_TRANSPORT = {"zmq": "zmq-tcp", "nixl": "nixl"}  # serve's workers talk over TCP


@dataclass
class Served:
    http: str
    urls: dict[str, list[str]]  # each /metrics URL the launcher printed -> what serves there
    prometheus: dict  # the configuration --prometheus-config wrote


@contextmanager
def served(logs: Path, *args: str) -> Iterator[Served]:
    port, config, out = free_port(), logs / "prometheus.yml", logs / "serve.out"
    command = [sys.executable, "-m", "dynamo_pd.serve", "--port", str(port), "--discovery-port", str(free_port()),
               "--namespace", f"test-{uuid.uuid4().hex[:8]}", "--prometheus-config", str(config), *args]
    with open(out, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
    try:
        deadline = time.monotonic() + _READY_S
        while "Prometheus configuration in" not in out.read_text():
            assert proc.poll() is None, f"serve exited with {proc.returncode}:\n{out.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"serve not ready within {_READY_S}s:\n{out.read_text()[-3000:]}"
            time.sleep(0.2)
        urls = {m[2]: m[1].split(", ") for line in out.read_text().splitlines() if (m := _METRICS_LINE.match(line))}
        yield Served(f"http://127.0.0.1:{port}", urls, yaml.safe_load(config.read_text()))
    finally:
        proc.send_signal(signal.SIGINT)  # serve stops every process it started
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def complete(http: str, prompt: str) -> None:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}).encode()
    request = urllib.request.Request(f"{http}/v1/completions", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200


def until_kv_moves(d: Served, decode_url: str, transport: str) -> None:
    """Warm-up requests until one's KV reached the decode worker from a prefill worker. A loaded host can stall a
    process starting its siblings past a 3 s lease; the worker registers again, and a request sent meanwhile is
    prefilled where it decodes. Warm-ups only add to what the checks count at least."""
    deadline = time.monotonic() + 180
    for i in range(10_000):
        complete(d.http, f"Warm-up {i}: " + prompts(1)[0])
        moved = value(scrape(decode_url), "dynamo_pd_worker_kv_transfers_total", worker="decode-0",
                      transport=transport, direction="in")
        if moved:
            return
        assert time.monotonic() < deadline, "no request's KV moved from a prefill worker within 180 s"
        time.sleep(1.0)


def prompts(n: int) -> list[str]:
    """Distinct prompts of several KV blocks, so each one's KV moves (no decode worker has it cached)."""
    words = ("river", "castle", "dragon", "lantern", "harbor", "meadow", "violin", "glacier", "orchard", "comet")
    rng = random.Random(7)
    return [f"Story {i}: " + " ".join(rng.choice(words) for _ in range(60)) for i in range(n)]


def bench_rate(transport: str) -> float:
    """The bytes per second benchmarks/transfer_bench.py measures for `transport` with its defaults (64 MiB
    pulls; the faster of contiguous and scattered block ids)."""
    block_bytes = transfer_bench.layout(1).block_bytes
    count = max(1, round(64 * 2**20 / block_bytes))
    num_blocks = count * 3
    patterns = {"contiguous": list(range(count, 2 * count)),
                "scattered": random.Random(0).sample(range(num_blocks), count)}
    results = asyncio.run(transfer_bench.measure(_BENCH_TRANSPORT[transport], patterns, num_blocks, iters=3))
    return max(count * block_bytes / results[name][0] for name in patterns)


def check_launcher_output(d: Served, workers: list[str]) -> dict[str, str]:
    """The printed URLs name the frontend and every worker; the Prometheus configuration scrapes exactly them.
    Returns each worker's URL."""
    frontend = f"{d.http}/metrics"
    assert d.urls[frontend] == ["frontend"]
    urls = {name: url for url, names in d.urls.items() for name in names if name != "frontend"}
    assert sorted(urls) == sorted(workers)
    target = {url: url.removeprefix("http://").removesuffix("/metrics") for url in d.urls}
    jobs = {job["job_name"]: sorted((c["targets"], c["labels"]["process"]) for c in job["static_configs"])
            for job in d.prometheus["scrape_configs"]}
    assert jobs == {"dynamo-pd-frontend": [([target[frontend]], "frontend")],
                    "dynamo-pd-workers": sorted(([target[url]], ",".join(names)) for url, names in d.urls.items()
                                                if url != frontend)}
    return urls


def check_workers(scraped: dict, urls: dict[str, str], sent: int, transport: str) -> dict[str, dict]:
    """Each metric of every worker, and what the `sent` requests imply; returns the transfer totals per side."""
    totals: dict[str, dict] = {}
    for name, url in urls.items():
        f = scraped[url]
        assert value(f, "dynamo_pd_worker_ready", worker=name) == 1
        assert value(f, "dynamo_pd_worker_requests_running", worker=name) >= 0
        assert value(f, "dynamo_pd_worker_requests_waiting", worker=name) >= 0
        total = value(f, "dynamo_pd_worker_kv_blocks_total", worker=name, tier="device")
        assert total > 0 and 0 <= value(f, "dynamo_pd_worker_kv_blocks_used", worker=name, tier="device") <= total
        steps = value(f, "dynamo_pd_worker_step_seconds_count", worker=name)
        assert steps is not None, f"{name} renders no engine steps"
        assert value(f, "dynamo_pd_worker_batch_size_count", worker=name) == steps  # one observation per step
        assert value(f, "dynamo_pd_worker_batch_size_sum", worker=name) >= steps
        assert value(f, "dynamo_pd_worker_step_seconds_sum", worker=name) > 0 or steps == 0
        failures = {s.labels["reason"]: s.value for s in f["dynamo_pd_worker_handoff_failures"].samples
                    if s.labels["worker"] == name and s.name.endswith("_total")}
        assert failures == dict.fromkeys([*FAILURE_REASONS, "engine_lease_expired"], 0.0)
        assert values(f, "dynamo_pd_worker_side_channel_malformed_total", worker=name, side="server") == [0.0]
        assert values(f, "dynamo_pd_worker_side_channel_malformed_total", worker=name, side="client") == [0.0]
        torn_down = values(f, "dynamo_pd_worker_nixl_agents_torn_down_total", worker=name)
        assert torn_down == ([0.0] if transport == "nixl" else [])
        totals[name] = {(direction, what): value(f, f"dynamo_pd_worker_kv_{what}_total", worker=name,
                                                 transport=transport, direction=direction)
                        for direction in ("in", "out") for what in ("transfers", "transfer_bytes", "transfer_seconds")}
        totals[name]["steps"] = steps
    prefills = [name for name in urls if name.startswith("prefill")]
    (decode,) = [name for name in urls if name.startswith("decode")]
    assert totals[decode]["steps"] >= sent and sum(totals[p]["steps"] for p in prefills) >= sent
    # every prompt's KV went from a prefill worker to the decode worker, and both sides counted it
    moved_in = totals[decode][("in", "transfers")]
    assert moved_in >= sent
    assert sum(totals[p][("out", "transfers")] for p in prefills) == moved_in
    assert sum(totals[p][("out", "transfer_bytes")] for p in prefills) == totals[decode][("in", "transfer_bytes")] > 0
    assert totals[decode][("in", "transfer_seconds")] > 0
    assert totals[decode][("out", "transfers")] == 0 and all(totals[p][("in", "transfers")] == 0 for p in prefills)
    return totals


def check_rates(totals: dict[str, dict], transport: str) -> None:
    """Bytes over the seconds transfers took, per worker and direction, against transfer_bench's best rate."""
    best = bench_rate(transport)
    for name, t in totals.items():
        for direction in ("in", "out"):
            if t[(direction, "transfers")]:
                rate = t[(direction, "transfer_bytes")] / t[(direction, "transfer_seconds")]
                assert 0 < rate <= best, f"{name} {direction}: {rate / 1e9:.3f} GB/s > the bench's {best / 1e9:.3f}"


def check_dashboard(scraped: dict) -> None:
    """Every metric the committed dashboard's queries name is one some process renders."""
    rendered = set().union(*(rendered_names(families) for families in scraped.values()))
    asked = set().union(*(metric_names(expr) for expr in dashboard_exprs()))
    assert asked and asked <= rendered, f"the dashboard asks for metrics nothing renders: {sorted(asked - rendered)}"


@pytest.mark.nixl
@needs_nixl
def test_every_process_of_a_mocker_deployment_serves_its_metrics(tmp_path):
    """Two prefill mockers share one process and one endpoint, each series labelled by its worker."""
    with served(tmp_path, "--engine", "mocker", "--prefill", "2", "--decode", "1", "--kv-transport", "nixl") as d:
        urls = check_launcher_output(d, ["prefill-0", "prefill-1", "decode-0"])
        assert urls["prefill-0"] == urls["prefill-1"] != urls["decode-0"]
        for url in set(urls.values()):
            assert get(url.replace("/metrics", "/ready"))[0] == 200
        until_kv_moves(d, urls["decode-0"], "nixl")
        sent = prompts(6)
        for prompt in sent:
            complete(d.http, prompt)
        scraped = {url: scrape(url) for url in d.urls}
    totals = check_workers(scraped, urls, len(sent), "nixl")
    frontend = scraped[f"{d.http}/metrics"]
    # the frontend's count of the bytes its requests' KV moved is the decode worker's
    assert value(frontend, "dynamo_pd_kv_transfer_bytes_total") == totals["decode-0"][("in", "transfer_bytes")]
    check_dashboard(scraped)
    check_rates(totals, "nixl")


def test_a_native_deployment_moves_kv_no_faster_than_the_transfer_benchmark(tmp_path):
    """Real KV (SmolLM2's, 720 KiB a block) over ZMQ, and the native engine's real step times."""
    with served(tmp_path, "--prefill", "1", "--decode", "1", "--kv-cache-memory-gb", "0.1") as d:
        urls = check_launcher_output(d, ["prefill-0", "decode-0"])
        until_kv_moves(d, urls["decode-0"], "zmq")
        sent = prompts(3)
        for prompt in sent:
            complete(d.http, prompt)
        scraped = {url: scrape(url) for url in d.urls}
    totals = check_workers(scraped, urls, len(sent), "zmq")
    assert totals["decode-0"][("in", "transfer_bytes")] >= len(sent) * 2 * 720 * 1024  # >= 2 blocks a prompt
    check_dashboard(scraped)
    check_rates(totals, "zmq")
