"""On NATS, each process opens one connection: a frontend and two workers are three connections on the
server, and the frontend's one carries the workers' KV events, their load reports and the replica updates."""

from __future__ import annotations

import json
import urllib.request

import pytest

from dynamo_pd.runtime.ports import free_port
from tests.e2e.conftest import MODEL, start_deployment
from tests.servers import nats_server

pytestmark = pytest.mark.slow


def connections(monitor_port: int) -> list[dict]:
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor_port}/connz?subs=1", timeout=10) as response:
        return json.loads(response.read())["connections"]


def test_a_frontend_and_two_workers_hold_one_nats_connection_each(tmp_path, openai_client_factory):
    monitor_port = free_port()
    with nats_server(tmp_path, monitor_port) as nats_url:
        deployment = start_deployment(tmp_path, "--prefill", "1", "--decode", "1", "--engine", "mocker",
                                      "--speedup", "10", "--nats", nats_url)
        try:
            client = openai_client_factory(deployment)
            prompt = list(range(1000, 1100))
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
            # the prefill worker's KV events reached the frontend's router over NATS
            deployment.wait_for(lambda: (deployment.metric("dynamo_pd_router_indexed_blocks",
                                                           worker="prefill-0") or 0) > 0, 30, "KV events indexed")
            conns = connections(monitor_port)
            assert len(conns) == 3, [c.get("subscriptions_list") for c in conns]
            ns = deployment.namespace
            frontend = [c for c in conns if f"{ns}.router.load" in c.get("subscriptions_list", [])]
            assert len(frontend) == 1
            assert {f"{ns}.load", f"{ns}.kv_events.prefill-0", f"{ns}.kv_events.decode-0"} <= set(
                frontend[0]["subscriptions_list"])
        finally:
            codes = deployment.stop()
    assert all(code == 0 for code in codes.values()), codes
