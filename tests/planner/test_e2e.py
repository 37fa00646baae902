"""The local connector grows and drains real native workers under load: a frontend as `serve --planner`
starts it, the workers through serve's hooks, greedy streamed completions sent all along. Not one request
fails, and every text is the one the same prompt got before any scaling."""

import asyncio
import itertools
import os
import subprocess
import threading
import uuid

import openai
import pytest

from dynamo_pd.planner.connectors.local import Launch, LocalConnector
from dynamo_pd.protocol import WorkerInfo
from dynamo_pd.runtime import connect_discovery
from dynamo_pd.runtime.ports import free_port
from dynamo_pd.serve import parse_args, plan, stop_children, worker_command
from tests.e2e.conftest import MODEL
from tests.waits import until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = [f"Write a short story about a {thing} who" for thing in
           ("lighthouse keeper", "robot", "gardener", "violinist", "cartographer", "baker")]
MAX_TOKENS = 48


class Load:
    """Clients streaming the prompts in turn until stopped; every answer kept."""

    def __init__(self, url: str, clients: int) -> None:
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        self.answers: list[tuple[str, str | Exception]] = []
        self._stop = threading.Event()
        self._prompts = itertools.cycle(PROMPTS)
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run) for _ in range(clients)]

    def complete(self, prompt: str) -> str:
        stream = self.client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True)
        return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                prompt = next(self._prompts)
            try:
                answer: str | Exception = self.complete(prompt)
            except Exception as exc:  # noqa: BLE001 - a failed request is what the test counts
                answer = exc
            with self._lock:
                self.answers.append((prompt, answer))

    def __enter__(self) -> "Load":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(300)


def metric(url: str, name: str, **labels: str) -> float | None:
    import urllib.request

    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        for line in response.read().decode().splitlines():
            key, _, value = line.rpartition(" ")
            if key == want:
                return float(value)
    return None


async def test_local_connector_grows_and_drains_native_workers_under_load(tmp_path):
    port, discovery_port = free_port(), free_port()
    namespace = f"test-{uuid.uuid4().hex[:8]}"
    # a short drain: requests still running on the drained worker after 1 s move to the other one (migration)
    args, engine_argv = parse_args(["--aggregated", "1", "--planner", "--ttft-slo", "1000", "--itl-slo",
                                    "100", "--port", str(port), "--discovery-port", str(discovery_port),
                                    "--namespace", namespace, "--kv-cache-memory-gb", "0.05",
                                    "--drain-timeout-s", "1"])
    discovery_url, commands = plan(args, engine_argv)
    assert len(commands) == 1  # the frontend: the connector starts the workers
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    processes: list[subprocess.Popen] = []
    with open(tmp_path / "frontend.log", "wb") as log:
        processes.append(subprocess.Popen(commands[0], env=env, stdout=log, stderr=subprocess.STDOUT))
    url = f"http://127.0.0.1:{port}"
    discovery = await connect_discovery(discovery_url, namespace=namespace, ttl_s=10.0)
    launch = Launch(command=lambda role, worker_id: worker_command(args, engine_argv, role, worker_id),
                    pool_command=None, env=env, log_dir=tmp_path, drain_timeout_s=1.0, ready_timeout_s=400.0)
    connector = LocalConnector(launch, discovery, ("aggregated",), processes)
    try:
        await connector.set_replicas("aggregated", 1)
        load = Load(url, clients=3)
        routing = lambda: metric(url, "dynamo_pd_worker_total_blocks", worker="aggregated-0") is not None  # noqa: E731
        await until(lambda: asyncio.to_thread(routing), "the frontend routing to aggregated-0", 120, poll_s=0.2)
        unfailed = {prompt: load.complete(prompt) for prompt in PROMPTS}  # one worker, one request at a time

        with load:
            await connector.set_replicas("aggregated", 2)  # returns once aggregated-1 registered
            running = lambda: (metric(url, "dynamo_pd_worker_running_requests", worker="aggregated-1") or 0) > 0  # noqa: E731
            await until(lambda: asyncio.to_thread(running), "requests running on aggregated-1", 120, poll_s=0.2)
            served = len(load.answers)
            await connector.set_replicas("aggregated", 1)  # aggregated-1 drains with requests in flight
            assert await connector.replicas() == {"aggregated": 1}
            await connector.wait_drained()
            assert {info.worker_id for info in await discovery.list(WorkerInfo)} == {"aggregated-0"}
            after = served + 2 * len(PROMPTS)
            await until(lambda: len(load.answers) >= after, "requests after the drain", 300, poll_s=0.2)
        failed = [(prompt, answer) for prompt, answer in load.answers if isinstance(answer, Exception)]
        assert not failed, failed
        wrong = [(prompt, answer) for prompt, answer in load.answers if answer != unfailed[prompt]]
        assert not wrong, f"{len(wrong)} of {len(load.answers)} texts differ from the unfailed: {wrong[:3]}"
        assert processes[-1].returncode == 0  # aggregated-1 drained and exited
    finally:
        await connector.close()
        await discovery.close()
        await asyncio.to_thread(stop_children, processes, 20)
