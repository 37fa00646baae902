"""The examples in examples/ run as their headers say."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from dynamo_pd.runtime.ports import free_port
from tests.e2e.conftest import Deployment

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_offline_generate_prints_each_prompt_and_reuses_the_repeated_one():
    done = subprocess.run([sys.executable, EXAMPLES / "offline_generate.py"], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 3 and lines[0].startswith("'Once upon a time, in a s' -> ")
    assert lines[0].split(" (")[0] == lines[2].split(" (")[0], "a repeated greedy prompt gives the same text"
    assert " 0 cached)" in lines[0] and " 0 cached)" not in lines[2], lines


@pytest.mark.nixl
def test_the_by_hand_deployment_serves_stream_chat(tmp_path, etcd_url, nats_url):
    """etcd + NATS + NIXL + push hand-off, each process started as a user would; SIGTERM stops all. The
    answer's KV moved prefill -> decode (a request that fell back to local prefill answers the same)."""
    pytest.importorskip("nixl", reason="NIXL is not installed (pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1)")
    port = free_port()
    log_path = tmp_path / "by_hand.log"
    env = dict(os.environ, ETCD=etcd_url, NATS=nats_url, PORT=str(port), NAMESPACE=f"ex-{uuid.uuid4().hex[:8]}",
               OMP_NUM_THREADS="1")
    with log_path.open("wb") as log:
        script = subprocess.Popen(["bash", EXAMPLES / "disaggregated_by_hand.sh"], stdout=log,
                                  stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while b"ready: http" not in log_path.read_bytes():
            assert script.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)
        chat = subprocess.run([sys.executable, EXAMPLES / "stream_chat.py", "Name a colour."], capture_output=True,
                              text=True, timeout=120,
                              env=dict(os.environ, OPENAI_BASE_URL=f"http://127.0.0.1:{port}/v1"))
        assert chat.returncode == 0, chat.stderr[-3000:]
        text, _, usage = chat.stdout.rpartition("\n[")
        assert text.strip() and "generated]" in usage, chat.stdout
        frontend = Deployment(url=f"http://127.0.0.1:{port}", logs=tmp_path)
        assert frontend.rendered_metric("dynamo_pd_kv_transfer_bytes_total") > 0
        for reason in ("prefill_failed", "transfer_failed"):
            assert frontend.rendered_metric("dynamo_pd_prefill_fallbacks_total", reason=reason) == 0, reason
        script.send_signal(signal.SIGTERM)
        assert script.wait(60) == 0, log_path.read_text()[-3000:]  # 0: every process it started stopped cleanly
    finally:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGKILL)
    log = log_path.read_text()
    assert "Traceback" not in log, log[-3000:]
