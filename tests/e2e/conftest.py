"""Real deployments on loopback: a frontend and workers as separate processes, exactly as
`python -m dynamo_pd.serve` starts them (its plan), so tests can kill single workers."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import uuid
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest

from dynamo_pd.runtime.ports import free_port
from dynamo_pd.serve import parse_args, plan, stop_children, worker_count
from tests.waits import wait

MODEL = "SmolLM2-135M-Instruct"
T = TypeVar("T")


@dataclass
class Deployment:
    url: str
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)  # "frontend", worker ids
    logs: Path | None = None
    namespace: str = ""
    killed: set[str] = field(default_factory=set)  # processes a test ended with SIGKILL (kill())

    def get(self, path: str, headers: dict | None = None) -> tuple[int, bytes]:
        request = urllib.request.Request(self.url + path, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def post(self, path: str, body: dict | bytes, headers: dict | None = None) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method="POST",
                                         headers={"content-type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def metric(self, name: str, **labels: str) -> float | None:
        _, text = self.get("/metrics")
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        for line in text.decode().splitlines():
            key, _, value = line.rpartition(" ")
            if key == (f"{name}{{{want}}}" if labels else name):
                return float(value)
        return None

    def rendered_metric(self, name: str, **labels: str) -> float:
        """metric(), but a metric /metrics does not render (renamed, never registered, a label value
        never initialised) fails, naming it, instead of reading as a missing value."""
        value = self.metric(name, **labels)
        assert value is not None, f"/metrics renders no {name} with labels {labels}; logs in {self.logs}"
        return value

    def wait_for(self, predicate, timeout_s: float = 20.0, what: str = "condition") -> None:
        wait(predicate, f"{what} (logs in {self.logs})", timeout_s)

    def spawn(self, name: str, command: list[str]) -> None:
        """Start one process of this deployment, its output in logs/<name>.log."""
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        with open(self.logs / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)

    def models(self) -> set[str]:
        """The models /v1/models lists (none while the frontend is not up); fails if a process exited."""
        for name, proc in self.procs.items():
            assert proc.poll() is None, f"{name} exited: {(self.logs / f'{name}.log').read_text()[-2000:]}"
        status, body = self.get("/v1/models")
        return {m["id"] for m in json.loads(body)["data"]} if status == 200 else set()

    def complete(self, prompt: str, max_tokens: int) -> str:
        """A greedy completion's text, asked of any OpenAI server (ours, or one we put behind a member)."""
        status, body = self.post("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        assert status == 200, body
        return body["choices"][0]["text"]

    def stop(self) -> dict[str, int]:
        """Stop it as `serve` does (workers first; what outlives 20 s is killed with the processes it started)
        and return each process's exit code."""
        stop_children(list(self.procs.values()), grace_s=20)
        return {name: proc.returncode for name, proc in self.procs.items()}

    def kill(self, name: str) -> None:
        """SIGKILL one process; stop_checked() expects its -SIGKILL (until a new process takes the name)."""
        self.procs[name].send_signal(signal.SIGKILL)
        self.killed.add(name)

    def stop_checked(self) -> None:
        """stop(), and check that each process exited 0 on SIGTERM, or -SIGKILL where kill() ended it."""
        codes = self.stop()
        expected = {name: -signal.SIGKILL if name in self.killed else 0 for name in codes}
        assert codes == expected, f"exit codes {codes}, expected {expected}; logs in {self.logs}"


def start_deployment(tmp_path: Path, *args: str, workers_expected: int | None = None,
                     timeout_s: float = 180.0, worker_args: dict[str, list[str]] | None = None) -> Deployment:
    """`args` go to the launcher; `worker_args` add flags to single workers (by worker id; a later
    flag overrides the launcher's)."""
    for attempt in range(1, _PORT_ATTEMPTS + 1):
        port = free_port()
        namespace = f"test-{uuid.uuid4().hex[:8]}"  # deployments sharing one etcd / NATS stay apart
        options, engine_argv = parse_args(["--port", str(port), "--discovery-port", str(free_port()),
                                           "--namespace", namespace, *args])
        _, commands = plan(options, engine_argv)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        deployment = Deployment(url=f"http://127.0.0.1:{port}", logs=tmp_path, namespace=namespace)
        for command in commands:
            name = command[command.index("--worker-id") + 1] if "--worker-id" in command else "frontend"
            command = command + (worker_args or {}).get(name, [])
            with open(tmp_path / f"{name}.log", "wb") as log:
                deployment.procs[name] = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        expected = workers_expected if workers_expected is not None else worker_count(options)
        try:
            deployment.wait_for(lambda: workers_registered(deployment) >= expected, timeout_s, "workers registered")
            return deployment
        except BaseException:
            deployment.stop()
            if attempt == _PORT_ATTEMPTS or not _lost_its_port(deployment):
                raise


# A port probed free can be bound by another test's server (they bind ports the kernel picks, from the same
# range) before the frontend binds it: seen once in CI, the discovery port. Such a start is tried again on new ports.
_PORT_ATTEMPTS = 3


def _lost_its_port(deployment: Deployment) -> bool:
    return any("Address already in use" in (deployment.logs / f"{name}.log").read_text(errors="replace")
               for name in deployment.procs)


def side_by_side(deployments: dict[str, Deployment], run: Callable[[str, Deployment], T]) -> dict[str, T]:
    """`run(name, deployment)` for every deployment at once, each in a thread of its own; the results by name. Each
    deployment still takes its own requests one after another, in the same order (prefix caches and batch shapes
    stay the same as alone), while the others use the cores it leaves idle."""
    with ThreadPoolExecutor(len(deployments)) as pool:
        running = {name: pool.submit(run, name, d) for name, d in deployments.items()}
        return {name: future.result() for name, future in running.items()}


@contextlib.contextmanager
def start_deployments(tmp_path_factory: pytest.TempPathFactory, args: dict[str, list[str]],
                      timeout_s: float = 180.0) -> Iterator[dict[str, Deployment]]:
    """start_deployment for each name -> launcher flags of `args`, side by side, each in a folder of its own;
    yields them by name (in `args`' order) and on leaving stops every one with stop_checked. A failed start is
    raised once every start has ended, the started ones stopped."""
    # made here, not in the threads: the factory's first call creates its base folder, and two threads
    # racing in it got two different ones (the second mktemp then fails)
    folders = {name: tmp_path_factory.mktemp(name) for name in args}
    started: dict[str, Deployment] = {}
    errors: list[BaseException] = []

    def start(name: str) -> None:
        try:
            started[name] = start_deployment(folders[name], *args[name], timeout_s=timeout_s)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after every start has ended
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(name,)) for name in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join()  # start_deployment's own timeout ends each
    with contextlib.ExitStack() as stop:  # every deployment stopped (and checked), whichever check fails
        for d in started.values():
            stop.callback(d.stop_checked)
        if errors:
            raise errors[0]
        yield {name: started[name] for name in args}


@pytest.fixture(scope="package")
def native(tmp_path_factory):
    """Native aggregated, 1P1D pull and 1P1D push deployments, for the modules that only send them requests
    (test_parity, test_n_best): started once, and stopped with the package, whose last modules they are
    (pytest_collection_modifyitems)."""
    # no health-check canaries: one would change a batch's shape, and with it the last bits of logprobs
    quiet = ["--health-check-interval-s", "0"]
    with start_deployments(tmp_path_factory, {
            "aggregated": ["--aggregated", "1", *quiet], "pull": ["--prefill", "1", "--decode", "1", *quiet],
            "push": ["--prefill", "1", "--decode", "1", "--kv-handoff", "push", *quiet]}) as deployments:
        yield deployments


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests on the shared `native` deployments run last in this package, so the package's end, right
    after them, stops those deployments (~2 GB each worker) instead of leaving them idle beside the later
    modules' own."""
    here = [i for i, item in enumerate(items) if Path(item.path).is_relative_to(Path(__file__).parent)]
    if not here:
        return
    block = items[here[0]:here[-1] + 1]
    shared = [item for item in block if "native" in getattr(item, "fixturenames", ())]
    items[here[0]:here[-1] + 1] = [item for item in block if item not in shared] + shared


def llama_server_command(port: int, n_ctx: int, *extra: str) -> list[str]:
    """llama-cpp-python's own OpenAI server on the SmolLM2 GGUF, one thread. A request arriving mid-stream (a
    second member's, a health canary) queues behind the one in flight instead of ending it, the server's default."""
    from dynamo_pd.model_store import default_gguf_path

    return [sys.executable, "-m", "llama_cpp.server", "--model", str(default_gguf_path()), "--host", "127.0.0.1",
            "--port", str(port), "--n_ctx", str(n_ctx), "--n_threads", "1", "--interrupt_requests", "False", *extra]


@contextlib.contextmanager
def with_openai_members(logs: Path, server_url: str, model: str, members: int, *frontend_args: str):
    """A frontend, `members` `--engine http` workers putting the OpenAI server at `server_url` behind `model`,
    and a native worker of MODEL beside them; yields once both models are served, and on leaving checks that
    every process exits cleanly."""
    port, discovery = free_port(), f"tcp://127.0.0.1:{free_port()}"
    namespace = f"test-{uuid.uuid4().hex[:8]}"
    deployment = Deployment(url=f"http://127.0.0.1:{port}", logs=logs, namespace=namespace)
    common = ["--discovery", discovery, "--namespace", namespace]
    deployment.spawn("frontend", [sys.executable, "-m", "dynamo_pd.frontend", "--port", str(port), *frontend_args,
                                  *common])
    for i in range(members):
        deployment.spawn(f"http-{i}", [sys.executable, "-m", "dynamo_pd.aggregated", "--engine", "http", "--url",
                                       server_url + "/v1", "--served-model-name", model, "--worker-id", f"http-{i}",
                                       *common])
    deployment.spawn("native-0", [sys.executable, "-m", "dynamo_pd.aggregated", "--worker-id", "native-0",
                                  "--kv-cache-memory-gb", "0.05", *common])
    try:
        deployment.wait_for(lambda: deployment.models() == {MODEL, model}, 240, "both models served")
    except BaseException:
        deployment.stop()
        raise
    yield deployment
    codes = deployment.stop()
    assert all(code == 0 for code in codes.values()), codes


def workers_registered(deployment: Deployment) -> int:
    for name, proc in deployment.procs.items():
        if proc.poll() is not None:
            log = (deployment.logs / f"{name}.log").read_text()[-3000:]
            raise AssertionError(f"{name} exited with {proc.returncode}:\n{log}")
    try:
        return sum(1 for line in deployment.get("/metrics")[1].decode().splitlines()
                   if line.startswith("dynamo_pd_worker_total_blocks{"))
    except OSError:
        return 0


@pytest.fixture(scope="module")
def openai_client_factory():
    import openai  # a dev dependency: its absence is a failure, not a skip

    def make(deployment: Deployment, api_key: str = "none"):
        return openai.OpenAI(base_url=deployment.url + "/v1", api_key=api_key, max_retries=0, timeout=120)

    return make
