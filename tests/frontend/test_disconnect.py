"""A client that leaves before its first token: the frontend notices while the prompt is still in
prefill and every worker frees what it held, without waiting for the first token."""

from __future__ import annotations

import http.client
import json
import time

import pytest

from tests.e2e.conftest import MODEL, Deployment

pytestmark = pytest.mark.slow


def _all_free(deployment: Deployment) -> bool:
    workers = [name for name in deployment.procs if name != "frontend"]
    return all(deployment.metric("dynamo_pd_worker_free_blocks", worker=w)
               == deployment.metric("dynamo_pd_worker_total_blocks", worker=w)
               and deployment.metric("dynamo_pd_worker_running_requests", worker=w) == 0 for w in workers)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_during_prefill_frees_every_worker(small_disagg: Deployment, stream: bool):
    deployment = small_disagg
    deployment.wait_for(lambda: _all_free(deployment), 30, "idle workers")
    first_tokens = deployment.rendered_metric("dynamo_pd_ttft_seconds_count")
    left = deployment.metric("dynamo_pd_requests_total", route="completion", status="499") or 0
    # ~1000 prompt tokens at 16 a step: about ten seconds of prefill on this CPU; distinct per case,
    # so no prefix cache shortens it
    prompt = [100 + int(stream) + 2 * i for i in range(1000)]
    host, port = deployment.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 100,
                                                        "stream": stream}),
                 {"content-type": "application/json"})
    deployment.wait_for(lambda: deployment.metric("dynamo_pd_queued_requests") == 1
                        and deployment.metric("dynamo_pd_worker_free_blocks", worker="prefill-0")
                        < deployment.metric("dynamo_pd_worker_total_blocks", worker="prefill-0"),
                        20, "the prompt in prefill")
    conn.close()
    gone_at = time.monotonic()
    # The frontend polls for the disconnect every 0.25 s and workers report their load every 0.5 s.
    deployment.wait_for(lambda: _all_free(deployment), 3, "every block free on every worker")
    print(f"blocks free {time.monotonic() - gone_at:.2f}s after the client left")
    assert deployment.rendered_metric("dynamo_pd_ttft_seconds_count") == first_tokens, "it ran to its first token"
    deployment.wait_for(lambda: deployment.metric("dynamo_pd_requests_total", route="completion", status="499")
                        == left + 1, 5, "the request counted as abandoned (499)")
