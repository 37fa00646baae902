"""Chaos on real loopback deployments: workers killed, etcd and NATS restarted or frozen, clients that
leave at random points. For each fault every request completes with the aggregated greedy text or ends
with a clear error (an OpenAI error body, or an error event in the stream) within its deadline, none
hangs, and afterwards every worker reports all its KV blocks free (what its prefix cache keeps counts
as free), from the load metrics the frontend serves at /metrics.

Each fault records a row (sent, completed, migrated, failed with a clear error, hung, unclear endings,
blocks leaked); the module prints the table at its end and writes it to chaos.json in its tmp dir.
Bounded: a few dozen requests per fault (500 short ones for the cancellations), 60 s per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import pytest

from dynamo_pd.runtime.ports import free_port
from tests.e2e.conftest import MODEL, Deployment, start_deployment
from tests.servers import binary, running_server

pytestmark = pytest.mark.slow

DEADLINE_S = 60.0  # per request: past it, the request hung
PROMPTS = [f"Write a short story about {topic}, in three sentences. " + " ".join(f"w{i}" for i in range(n))
           for topic, n in (("a lighthouse", 60), ("a fox", 90), ("the sea", 120), ("a clock", 150))]


@dataclass
class Row:
    fault: str
    sent: int = 0
    completed: int = 0
    migrated: int | None = None  # None: the frontend has no migration metric
    failed_clearly: int = 0
    cancelled: int = 0
    hung: int = 0
    unclear: int = 0  # wrong text, or a stream cut without an error
    blocks_leaked: int = 0
    held_by: str = ""  # which worker holds the leaked blocks


ROWS: list[Row] = []


@pytest.fixture(scope="module", autouse=True)
def chaos_table(tmp_path_factory, request):
    yield
    path = tmp_path_factory.mktemp("chaos") / "chaos.json"
    path.write_text(json.dumps([asdict(row) for row in ROWS], indent=1))
    out = request.config.pluginmanager.get_plugin("terminalreporter")
    lines = ["", f"chaos table ({path}):",
             "| fault | sent | completed | migrated | failed (clear error) | cancelled | hung | unclear "
             "| blocks leaked |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in ROWS:
        migrated = "n/a" if r.migrated is None else r.migrated
        lines.append(f"| {r.fault} | {r.sent} | {r.completed} | {migrated} | {r.failed_clearly} | {r.cancelled} "
                     f"| {r.hung} | {r.unclear} | {r.blocks_leaked} |")
    for line in lines:
        (out.write_line(line) if out is not None else print(line))


# ---- the client side


async def stream(client: httpx.AsyncClient, prompt: str, max_tokens: int, expected: str | None,
                 progress: list[int] | None = None) -> str:
    """One streamed greedy completion: 'completed', 'error' (clear), or 'unclear' (wrong text, cut stream)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text = []
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                error = json.loads(await response.aread()).get("error", {})
                return "error" if error.get("message") else "unclear"
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return "error" if event["error"].get("message") else "unclear"
                if event["choices"]:
                    text.append(event["choices"][0]["text"])
                    if progress is not None:
                        progress.append(1)
    except (httpx.TransportError, json.JSONDecodeError):
        return "unclear"  # the frontend closed the stream without saying why
    return "completed" if expected is None or "".join(text) == expected else "unclear"


async def bounded(request) -> str:
    try:
        return await asyncio.wait_for(request, DEADLINE_S)
    except asyncio.TimeoutError:
        return "hung"


def client_for(deployment: Deployment) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=deployment.url, timeout=httpx.Timeout(DEADLINE_S + 10),
                             limits=httpx.Limits(max_connections=64))


# (deployment namespace, max_tokens) -> prompt -> text: the namespace is each start's own, a URL's port is
# free again for a later deployment once this one stops
_EXPECTED: dict[tuple[str, int], dict[str, str]] = {}


async def expected_texts(deployment: Deployment, max_tokens: int) -> dict[str, str]:
    """The prompts' greedy texts, asked once per deployment and length: the faults one after another on the
    etcd / NATS deployment compare with the texts it gave before the first (seconds a request under load)."""
    key = (deployment.namespace, max_tokens)
    if key in _EXPECTED:
        return _EXPECTED[key]
    async with client_for(deployment) as client:
        texts = {}
        for prompt in PROMPTS:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            texts[prompt] = response.json()["choices"][0]["text"]
    _EXPECTED[key] = texts
    return texts


# ---- the server side


def metrics(deployment: Deployment) -> dict[str, float]:
    _, text = deployment.get("/metrics")
    values = {}
    for line in text.decode().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values


def migrations(deployment: Deployment) -> float | None:
    found = [v for k, v in metrics(deployment).items() if k.startswith("dynamo_pd_migrations_total")]
    return sum(found) if found else None


def blocks_held(deployment: Deployment) -> dict[str, int]:
    """Per live worker: KV blocks its last load report says are neither free nor cached."""
    values = metrics(deployment)
    held = {}
    for key, total in values.items():
        if key.startswith("dynamo_pd_worker_total_blocks{"):
            labels = key[len("dynamo_pd_worker_total_blocks"):]
            held[labels] = int(total - values.get("dynamo_pd_worker_free_blocks" + labels, 0))
    return held


async def leaked_blocks(deployment: Deployment, timeout_s: float = 45.0) -> dict[str, int]:
    """Blocks each worker still holds once they have had `timeout_s` to free them (hand-off leases expire)."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = await asyncio.to_thread(blocks_held, deployment)
        if held and not any(held.values()) or time.monotonic() > deadline:
            return held
        await asyncio.sleep(0.5)


async def record(row: Row, deployment: Deployment, outcomes: list[str], migrated_before: float | None) -> Row:
    counts = Counter(outcomes)
    row.sent = len(outcomes)
    row.completed, row.failed_clearly, row.hung = counts["completed"], counts["error"], counts["hung"]
    row.cancelled, row.unclear = counts["cancelled"], counts["unclear"]
    after = await asyncio.to_thread(migrations, deployment)
    row.migrated = None if after is None else int(after - (migrated_before or 0))
    held = await leaked_blocks(deployment)
    row.blocks_leaked, row.held_by = sum(held.values()), json.dumps({k: v for k, v in held.items() if v})
    ROWS.append(row)
    return row


def check(row: Row) -> None:
    assert row.hung == 0 and row.unclear == 0 and row.blocks_leaked == 0, row
    assert row.completed + row.failed_clearly + row.cancelled == row.sent, row


async def steady_load(deployment: Deployment, expected: dict[str, str], max_tokens: int, count: int,
                      concurrency: int, progress: list[int] | None = None) -> list[str]:
    gate = asyncio.Semaphore(concurrency)
    async with client_for(deployment) as client:
        async def one(i: int) -> str:
            async with gate:
                prompt = PROMPTS[i % len(PROMPTS)]
                return await bounded(stream(client, prompt, max_tokens, expected[prompt], progress))

        return list(await asyncio.gather(*(one(i) for i in range(count))))


# ---- one deployment with a prefill and two decode workers (embedded discovery, ZMQ planes)


@pytest.fixture(scope="module")
def p1d2(tmp_path_factory):
    deployment = start_deployment(tmp_path_factory.mktemp("chaos_p1d2"), "--prefill", "1", "--decode", "2",
                                  worker_args={"prefill-0": ["--max-num-batched-tokens", "32"]}, timeout_s=420)
    yield deployment
    deployment.stop_checked()  # the workers the tests killed end -SIGKILL, the rest drain and exit 0


async def test_500_client_cancellations_at_random_points(p1d2):
    expected = await expected_texts(p1d2, 12)
    rng = random.Random(0)
    gate = asyncio.Semaphore(8)

    async with client_for(p1d2) as client:
        async def one(i: int) -> str:
            async with gate:
                prompt = PROMPTS[i % len(PROMPTS)]
                request = asyncio.ensure_future(stream(client, prompt, 12, expected[prompt]))
                done, _ = await asyncio.wait({request}, timeout=rng.uniform(0.0, 1.5))
                if done:
                    return request.result()
                request.cancel()  # the client goes away: before routing, in prefill, in transfer or mid-stream
                with contextlib.suppress(asyncio.CancelledError):
                    await request
                return "cancelled"

        outcomes = list(await asyncio.gather(*(one(i) for i in range(500))))
        # and the deployment still answers right
        outcomes += await steady_load(p1d2, expected, 12, 8, 4)
    check(await record(Row("500 client cancellations (concurrency 8)"), p1d2, outcomes, None))


def fallbacks(deployment: Deployment) -> float:
    """Requests that fell back to local prefill, for either reason (both rendered from the start)."""
    values = metrics(deployment)
    return sum(values[f'dynamo_pd_prefill_fallbacks_total{{reason="{reason}"}}']
               for reason in ("prefill_failed", "transfer_failed"))


async def test_kill_9_the_prefill_worker_mid_transfer(p1d2):
    """Every request completes: those in prefill or hand-off fall back to prefill on their decode worker
    (--on-prefill-failure local, the default), and the decode workers serve alone after the fault."""
    expected = await expected_texts(p1d2, 16)
    before, fell_back_before = migrations(p1d2), fallbacks(p1d2)
    progress: list[int] = []
    load = asyncio.ensure_future(steady_load(p1d2, expected, 16, 24, 8, progress))
    async with asyncio.timeout(60):
        while not progress:  # the first request has its first token: others are in prefill or hand-off
            await asyncio.sleep(0.01)
    p1d2.kill("prefill-0")
    outcomes = await load
    outcomes += await steady_load(p1d2, expected, 16, 4, 4)  # decode workers prefill alone now
    row = await record(Row("kill -9 prefill worker mid-transfer"), p1d2, outcomes, before)
    check(row)
    assert row.completed == row.sent, row  # no request is lost: each falls back
    assert fallbacks(p1d2) > fell_back_before, "the kill hit no request in prefill or hand-off"


async def test_kill_9_a_decode_worker_mid_stream(p1d2):
    expected = await expected_texts(p1d2, 48)
    before = migrations(p1d2)
    progress: list[int] = []
    load = asyncio.ensure_future(steady_load(p1d2, expected, 48, 16, 8, progress))
    async with asyncio.timeout(60):
        while len(progress) < 24:  # several streams are past their first tokens
            await asyncio.sleep(0.01)
    p1d2.kill("decode-0")
    outcomes = await load
    outcomes += await steady_load(p1d2, expected, 48, 4, 4)  # the other decode worker serves on
    row = await record(Row("kill -9 decode worker mid-stream"), p1d2, outcomes, before)
    check(row)
    assert outcomes[-4:] == ["completed"] * 4, row


# ---- one deployment on etcd and NATS the test can restart and freeze


class Restartable:
    """A server on fixed loopback ports, stopped (SIGTERM) and started again with the same data."""

    def __init__(self, args: list[str], port: int, log_dir: Path, exit_code: int) -> None:
        # exit_code: what it ends with on SIGTERM, by its own shutdown (etcd re-raises the signal)
        self.args, self.port, self.log_dir, self.exit_code = args, port, log_dir, exit_code
        self._stack = contextlib.ExitStack()
        self.proc = None
        self.log: Path | None = None

    def start(self) -> None:
        self.log = self.log_dir / f"{Path(self.args[0]).name}-{time.time():.0f}.log"
        self.proc = self._stack.enter_context(running_server(self.args, self.port, self.log))

    def stop(self) -> None:
        self._stack.close()  # SIGTERM; one still running 5 s later is killed, and fails the check below
        assert self.proc.returncode == self.exit_code, (self.args[0], self.proc.returncode,
                                                        self.log.read_text()[-2000:])


@pytest.fixture(scope="module")
def on_etcd_nats(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chaos_etcd_nats")
    etcd_port, peer_port, nats_port = free_port(), free_port(), free_port()
    etcd = Restartable([binary("etcd"), "--data-dir", str(tmp / "etcd"), "--name", "chaos",
                        "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
                        "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
                        "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
                        "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
                        "--initial-cluster", f"chaos=http://127.0.0.1:{peer_port}", "--log-level", "error"],
                       etcd_port, tmp, exit_code=-signal.SIGTERM)
    nats = Restartable([binary("nats-server"), "-a", "127.0.0.1", "-p", str(nats_port)], nats_port, tmp,
                       exit_code=0)
    etcd.start()
    nats.start()
    try:
        deployment = start_deployment(tmp, "--prefill", "1", "--decode", "1", "--etcd", f"etcd://127.0.0.1:{etcd_port}",
                                      "--nats", f"nats://127.0.0.1:{nats_port}", timeout_s=420)
        try:
            yield deployment, etcd, nats
        finally:
            deployment.stop_checked()
    finally:
        try:
            nats.stop()
        finally:
            etcd.stop()


async def fault_under_load(deployment: Deployment, name: str, fault) -> None:
    expected = await expected_texts(deployment, 16)
    before = migrations(deployment)
    progress: list[int] = []
    load = asyncio.ensure_future(steady_load(deployment, expected, 16, 32, 4, progress))
    async with asyncio.timeout(60):
        while not progress:
            await asyncio.sleep(0.01)
    await fault()
    outcomes = await load
    outcomes += await steady_load(deployment, expected, 16, 4, 4)
    row = await record(Row(name), deployment, outcomes, before)
    check(row)
    assert outcomes[-4:] == ["completed"] * 4, row  # the deployment serves right after the fault


@pytest.mark.parametrize("server", ["etcd", "NATS"])
async def test_restart_a_server(on_etcd_nats, server):
    deployment, etcd, nats = on_etcd_nats
    proc = etcd if server == "etcd" else nats

    async def fault():
        proc.stop()
        await asyncio.sleep(3.0)
        proc.start()

    await fault_under_load(deployment, f"restart {server} (down 3 s)", fault)


async def test_event_plane_blackout_of_5_s(on_etcd_nats):
    deployment, _, nats = on_etcd_nats

    async def fault():
        nats.proc.send_signal(signal.SIGSTOP)  # connections stay open and silent: KV events and load stall
        try:
            await asyncio.sleep(5.0)
        finally:
            nats.proc.send_signal(signal.SIGCONT)

    await fault_under_load(deployment, "event plane (NATS) frozen 5 s", fault)
