"""Migration and graceful drain in a real 1P2D deployment (native engine, greedy): a decode worker
killed with SIGKILL mid-stream, and every worker restarted one by one with SIGTERM under a steady load.
The client sees one uninterrupted stream with the text an unfailed run gives (1P1D text equals the
aggregated text: test_serving / test_parity), and no request fails."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from tests.e2e.conftest import MODEL, Deployment, start_deployment, workers_registered

PROMPTS = ["Count from one to fifty in words, separated by commas:", "List the months of the year, one per line:",
           "Write the alphabet in capital letters, separated by spaces:"]


@pytest.fixture(scope="module")
def p1d2(tmp_path_factory):
    deployment = start_deployment(tmp_path_factory.mktemp("p1d2"), "--prefill", "1", "--decode", "2",
                                  "--kv-cache-memory-gb", "0.1")
    yield deployment
    deployment.stop_checked()  # the restarted workers too


def completion(deployment: Deployment, prompt: str, max_tokens: int) -> dict:
    status, body = deployment.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                       "temperature": 0})
    assert status == 200, body
    return body


def complete(deployment: Deployment, prompt: str, max_tokens: int) -> str:
    return completion(deployment, prompt, max_tokens)["choices"][0]["text"]


@pytest.mark.slow
def test_a_decode_worker_killed_mid_stream_is_migrated_and_the_text_is_the_unfailed_one(p1d2, openai_client_factory):
    prompt, max_tokens = PROMPTS[0], 120
    unfailed = completion(p1d2, prompt, max_tokens)
    client = openai_client_factory(p1d2)
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                      temperature=0, stream=True,
                                                      stream_options={"include_usage": True})
    victim = raw.headers["x-dynamo-pd-worker"]  # where the frontend placed the stream
    assert victim in ("decode-0", "decode-1"), victim
    stream = iter(raw.parse())
    chunks = [next(stream) for _ in range(4)]
    p1d2.kill(victim)
    chunks += list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == unfailed["choices"][0]["text"]
    usage = chunks[-1].usage  # the whole request, once
    assert (usage.prompt_tokens, usage.completion_tokens) == (unfailed["usage"]["prompt_tokens"],
                                                              unfailed["usage"]["completion_tokens"])
    assert p1d2.metric("dynamo_pd_migrations_total", reason="worker_gone") == 1
    restart(p1d2, victim)


def worker_logs(deployment: Deployment, name: str) -> list[Path]:
    """The logs of each process that ran as `name`, the first one's first."""
    restarts = len(list(deployment.logs.glob(f"{name}.restarted-*.log")))
    return [deployment.logs / f"{name}.log", *(deployment.logs / f"{name}.restarted-{i}.log"
                                                for i in range(1, restarts + 1))]


def restart(deployment: Deployment, name: str) -> None:
    """Stop a worker with SIGTERM (it drains, and must exit 0) unless a test killed it (-SIGKILL), start it
    again with its command (a log of its own), and wait until that process says it is ready and all three
    workers are registered."""
    old, old_log = deployment.procs[name], worker_logs(deployment, name)[-1]
    drained = name not in deployment.killed
    if drained:
        old.send_signal(signal.SIGTERM)
    code = old.wait(60)
    assert code == (0 if drained else -signal.SIGKILL), f"{name} exited {code}: {old_log.read_text()[-3000:]}"
    if drained:
        assert f"worker {name} draining" in old_log.read_text(), old_log.read_text()[-3000:]
    deployment.killed.discard(name)
    new_log = deployment.logs / f"{name}.restarted-{len(worker_logs(deployment, name))}.log"
    with open(new_log, "wb") as log:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        deployment.procs[name] = subprocess.Popen(old.args, stdout=log, stderr=subprocess.STDOUT, env=env)
    deployment.wait_for(lambda: f"worker {name} ready" in new_log.read_text()
                        and workers_registered(deployment) >= 3
                        and all((deployment.metric("dynamo_pd_worker_total_blocks", worker=w) or 0) > 0
                                for w in ("prefill-0", "decode-0", "decode-1")), 180, f"{name} back")


@pytest.mark.slow
def test_a_rolling_sigterm_restart_under_load_fails_no_request(p1d2):
    expected = {prompt: complete(p1d2, prompt, 24) for prompt in PROMPTS}
    stop = threading.Event()
    results: list[tuple[str, str | None, str]] = []  # prompt, text or None, error

    def client(i: int) -> None:
        n = 0
        while not stop.is_set():
            prompt = PROMPTS[(i + n) % len(PROMPTS)]
            n += 1
            try:
                results.append((prompt, complete(p1d2, prompt, 24), ""))
            except Exception as exc:  # noqa: BLE001 - an error status, a reset connection, a timeout: a failure
                results.append((prompt, None, repr(exc)))

    def served_more(n: int) -> None:  # the load runs between restarts, not only around them
        done = len(results)
        p1d2.wait_for(lambda: len(results) >= done + n, 120, f"{n} more requests answered")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    try:
        for name in ("prefill-0", "decode-0", "decode-1"):
            served_more(3)
            restart(p1d2, name)
        served_more(3)
    finally:
        stop.set()
        for thread in threads:
            thread.join(150)
    assert not any(thread.is_alive() for thread in threads), "a request hung"
    failed = [r for r in results if r[1] is None]
    assert not failed, failed[:3]
    wrong = [r for r in results if r[1] != expected[r[0]]]
    assert not wrong, wrong[:3]
    assert len(results) >= 10
    for name in ("prefill-0", "decode-0", "decode-1"):
        for log in worker_logs(p1d2, name):
            assert "Traceback" not in log.read_text(), log
