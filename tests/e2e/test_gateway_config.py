"""The configuration file reloaded on SIGHUP, end to end: a stream in flight while the frontend
re-reads its file (now with a per-key rate limit) runs to its end, whole, and the requests after the
reload see the new limit (429 with Retry-After); a bad file then is refused and changes nothing."""

from __future__ import annotations

import http.client
import json
import signal
import time
from urllib.parse import urlparse

import pytest

from tests.e2e.conftest import MODEL, start_deployment

pytestmark = pytest.mark.slow
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    logs = tmp_path_factory.mktemp("config")
    config = logs / "gateway.toml"
    config.write_text("[health]\ninterval_s = 0\n")
    deployment = start_deployment(logs, "--aggregated", "1", "--kv-cache-memory-gb", "0.2", "--config", str(config))
    deployment.config = config
    yield deployment
    deployment.stop_checked()


def probe(deployment) -> int:
    return deployment.post("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1})[0]


def test_a_sighup_reload_changes_a_limit_while_a_stream_in_flight_completes(deployment):
    assert [probe(deployment) for _ in range(4)] == [200] * 4  # no limit yet
    url = urlparse(deployment.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": MODEL, "prompt": "Tell me a long story.", "max_tokens": MAX_TOKENS, "ignore_eos": True,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}),
        {"content-type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    first = response.readline()
    assert first.startswith(b"data: ")

    deployment.config.write_text("[health]\ninterval_s = 0\n\n[limits]\nper_key = { requests_per_s = 0.2 }\n")
    deployment.procs["frontend"].send_signal(signal.SIGHUP)
    deadline, statuses = time.monotonic() + 30, []
    while 429 not in statuses and time.monotonic() < deadline:
        statuses.append(probe(deployment))
    assert statuses[-1] == 429, statuses  # the new limit: one request per 5 s
    assert deployment.metric("dynamo_pd_inflight_requests") >= 1  # the stream still runs

    deployment.config.write_text("[limits]\nper_key = { requests_per_s = -1 }\n")  # refused: nothing changes
    deployment.procs["frontend"].send_signal(signal.SIGHUP)
    log = deployment.logs / "frontend.log"
    deployment.wait_for(lambda: "reload refused" in log.read_text(), 30, "the bad file read and refused")
    status, body = deployment.post("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert status == 429 and body["error"]["code"] == "rate_limit_exceeded"

    chunks = [first] + [line for line in response.read().splitlines() if line.startswith(b"data: ")]
    conn.close()
    assert chunks[-1] == b"data: [DONE]"
    events = [json.loads(c[6:]) for c in chunks[:-1]]
    assert not any("error" in e for e in events)
    assert events[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["length"]
    text = log.read_text()
    assert "configuration reloaded" in text and "limits.per_key.requests_per_s must be a number >= 0" in text
