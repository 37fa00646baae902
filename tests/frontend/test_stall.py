"""A worker that stops producing after its first tokens: the frontend's inter-token deadline ends the
stream with a clear error, and the worker frees the request's blocks once it runs again."""

from __future__ import annotations

import http.client
import json
import os
import signal

import pytest

from tests.e2e.conftest import MODEL, Deployment, start_deployment

pytestmark = pytest.mark.slow
DEADLINE_S = 1.0  # under the RPC heartbeat's 3 s, which would otherwise end it as a dead worker


@pytest.fixture(scope="module")
def aggregated(tmp_path_factory):
    deployment = start_deployment(tmp_path_factory.mktemp("stall"), "--aggregated", "1",
                                  worker_args={"frontend": ["--inter-token-timeout-s", str(DEADLINE_S)]})
    yield deployment
    codes = deployment.stop()
    assert all(code == 0 for code in codes.values()), codes


def _events(response: http.client.HTTPResponse):
    for line in response:
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            yield json.loads(line[len(b"data: "):])


def test_a_worker_that_stops_producing_ends_the_stream_with_a_clear_error(aggregated: Deployment):
    worker = aggregated.procs["aggregated-0"]
    host, port = aggregated.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "Count to a thousand:",
                                                        "max_tokens": 2000, "ignore_eos": True, "stream": True}),
                 {"content-type": "application/json"})
    events, stopped = _events(conn.getresponse()), False
    try:
        for event in events:
            if "error" in event:
                break
            if not stopped and event["choices"][0]["text"]:
                os.kill(worker.pid, signal.SIGSTOP)  # the whole engine wedges; the process lives
                stopped = True
        else:
            pytest.fail("the stream ended without an error")
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        conn.close()
    assert stopped
    assert event["error"]["code"] == "worker_stalled", event
    assert "tcp://" not in event["error"]["message"]

    def freed() -> bool:
        return (aggregated.metric("dynamo_pd_worker_free_blocks", worker="aggregated-0")
                == aggregated.metric("dynamo_pd_worker_total_blocks", worker="aggregated-0")
                and aggregated.metric("dynamo_pd_worker_running_requests", worker="aggregated-0") == 0)

    aggregated.wait_for(freed, 20, "the stalled request's blocks freed once the worker runs again")
    assert aggregated.metric("dynamo_pd_requests_total", route="completion", status="503") == 1
