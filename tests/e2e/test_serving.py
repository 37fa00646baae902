"""Disaggregated serving end to end: real processes on loopback, the official openai client."""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import threading

import pytest

from dynamo_pd.runtime.ports import free_port
from tests.e2e.conftest import MODEL, Deployment, start_deployment, workers_registered

pytestmark = pytest.mark.slow
API_KEY = "test-key"
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def aggregated(tmp_path_factory):
    """Started with the launcher users type, so its readiness report and Ctrl-C are tested too."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("aggregated") / "serve.log"
    log = open(log_path, "w+b")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dynamo_pd.serve", "--aggregated", "1", "--port", str(port),
         "--discovery-port", str(free_port()), "--api-key", API_KEY],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    deployment = Deployment(url=f"http://127.0.0.1:{port}", logs=log_path)
    deployment.wait_for(lambda: b"dynamo-pd ready" in log_path.read_bytes() or proc.poll() is not None, 180,
                        "launcher ready")
    assert proc.poll() is None, log_path.read_text()
    yield deployment
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 0, log_path.read_text()[-3000:]
    assert b"dynamo-pd: stopping" in log_path.read_bytes()


@pytest.fixture(scope="module", params=["embedded", "etcd+nats", "push"])
def disagg(request, tmp_path_factory):
    """2 prefill + 1 decode workers; discovery and events embedded (ZMQ), or on real etcd and NATS;
    the decode worker pulls the KV, or (push) reserves blocks the prefill workers write, SGLang style."""
    planes = []
    if request.param == "etcd+nats":
        planes = ["--etcd", request.getfixturevalue("etcd_url"), "--nats", request.getfixturevalue("nats_url")]
    if request.param == "push":
        planes = ["--kv-handoff", "push"]
    deployment = start_deployment(tmp_path_factory.mktemp("disagg"), "--prefill", "2", "--decode", "1",
                                  "--handoff-lease-s", "120", *planes)
    yield deployment
    codes = deployment.stop()
    assert all(code == 0 for code in codes.values()), codes


def chat_text(client, prompt: str, **kwargs) -> str:
    response = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                              temperature=0, max_tokens=32, **kwargs)
    return response.choices[0].message.content


def test_openai_client_streams_1p1d_with_the_same_greedy_text_as_aggregated(aggregated, disagg, openai_client_factory):
    agg_client = openai_client_factory(aggregated, API_KEY)
    pd_client = openai_client_factory(disagg)
    for prompt in PROMPTS:
        stream = pd_client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=32,
            stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        assert len(chunks) > 3, "tokens arrive as separate chunks"
        assert text and text == chat_text(agg_client, prompt)
        assert usage.completion_tokens <= 32 and usage.prompt_tokens > 10
    assert disagg.metric("dynamo_pd_kv_transfer_bytes_total") > 0
    for reason in ("prefill_failed", "transfer_failed"):  # equal text must not come from a fallback
        assert disagg.rendered_metric("dynamo_pd_prefill_fallbacks_total", reason=reason) == 0


def indexed_prefill_blocks(deployment) -> float:
    return sum(deployment.metric("dynamo_pd_router_indexed_blocks", worker=w) or 0 for w in ("prefill-0", "prefill-1"))


def test_a_shared_prefix_goes_to_the_prefill_worker_that_holds_it(disagg, openai_client_factory):
    """Per topic, a cold request (nothing cached: what any router gets) and one sharing its prefix,
    which only prefix-aware routing serves from cache (round robin over the 2 prefill workers never)."""
    client = openai_client_factory(disagg)
    prompt_before = disagg.metric("dynamo_pd_prompt_tokens_total")
    cached_before = disagg.metric("dynamo_pd_cached_prompt_tokens_total")
    prompt_tokens = cached_tokens = 0
    for topic in ("rivers", "mountains", "deserts", "forests"):
        prefix = f"Here is a long document about {topic}. " + " ".join(f"{topic}-{i}" for i in range(120))
        before = indexed_prefill_blocks(disagg)
        first = client.completions.create(model=MODEL, prompt=prefix, max_tokens=1, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0, topic
        disagg.wait_for(lambda: indexed_prefill_blocks(disagg) >= before + first.usage.prompt_tokens // 16 - 1,
                        20, "the KV events of the first request reached the router")
        second = client.completions.create(model=MODEL, prompt=prefix + " And one more line.", max_tokens=1,
                                           temperature=0)
        cached = second.usage.prompt_tokens_details.cached_tokens
        full_blocks = first.usage.prompt_tokens // 16 * 16
        assert cached >= full_blocks - 16, (topic, cached, first.usage.prompt_tokens)
        prompt_tokens += first.usage.prompt_tokens + second.usage.prompt_tokens
        cached_tokens += cached
    # the frontend's KV metrics count exactly what the clients were told
    disagg.wait_for(lambda: disagg.metric("dynamo_pd_prompt_tokens_total") == prompt_before + prompt_tokens, 10,
                    "usage recorded")
    assert disagg.metric("dynamo_pd_cached_prompt_tokens_total") == cached_before + cached_tokens
    assert disagg.metric("dynamo_pd_kv_hit_rate") == pytest.approx(
        (cached_before + cached_tokens) / (prompt_before + prompt_tokens))


def test_a_client_that_disconnects_mid_stream_frees_blocks_on_every_worker(disagg, openai_client_factory):
    client = openai_client_factory(disagg)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count from one to a thousand."}],
        max_tokens=400, stream=True, extra_body={"ignore_eos": True})
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received == 3:
            break
    stream.close()
    workers = [name for name in disagg.procs if name != "frontend"]

    def all_free() -> bool:
        return all(disagg.rendered_metric("dynamo_pd_worker_free_blocks", worker=w)
                   == disagg.rendered_metric("dynamo_pd_worker_total_blocks", worker=w)
                   and disagg.rendered_metric("dynamo_pd_worker_running_requests", worker=w) == 0
                   for w in workers)

    # well before the 120 s hand-off lease: the cancellation itself frees them
    disagg.wait_for(all_free, 15, "every block free on every worker")


def test_http_errors_are_openai_error_bodies(aggregated):
    auth = {"authorization": f"Bearer {API_KEY}"}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert aggregated.get("/health")[0] == 200  # open without a key
    status, body = aggregated.post("/v1/chat/completions", chat)
    assert status == 401 and body["error"]["type"] == "authentication_error"
    assert aggregated.post("/v1/chat/completions", chat, {"authorization": "Bearer wrong"})[0] == 401
    status, body = aggregated.post("/v1/chat/completions", {**chat, "temperature": -1}, auth)
    assert status == 400 and body["error"]["param"] == "temperature", body
    status, body = aggregated.post("/v1/chat/completions", b"{not json", auth)
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = aggregated.post("/v1/chat/completions", {**chat, "model": "gpt-nothing"}, auth)
    assert status == 404 and body["error"]["code"] == "model_not_found"
    long_prompt = {"model": MODEL, "prompt": "word " * 9000, "max_tokens": 4}
    status, body = aggregated.post("/v1/completions", long_prompt, auth)
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert _declared_oversize_body_status(aggregated, auth) == 413
    assert _chunked_oversize_body_status(aggregated, auth) == 413
    status, body = aggregated.post("/v1/chat/completions", {**chat, "messages": []}, auth)
    assert status == 400 and body["error"]["param"] == "messages"
    status, schema = aggregated.get("/openapi.json", auth)
    assert status == 200 and b"/v1/chat/completions" in schema
    status, body = aggregated.post("/v1/completions", {"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 5,
                                                       "temperature": 0, "logprobs": 2}, auth)
    assert status == 200 and len(body["choices"][0]["logprobs"]["top_logprobs"]) == body["usage"]["completion_tokens"]


def _declared_oversize_body_status(deployment: Deployment, headers: dict) -> int:
    """A body declared over the 4 MiB limit is refused from its headers, before it is read."""
    host, port = deployment.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/v1/completions")
    for name, value in {**headers, "content-type": "application/json", "content-length": str(5 << 20)}.items():
        conn.putheader(name, value)
    conn.endheaders(b'{"model": "')
    status = conn.getresponse().status
    conn.close()
    return status


def _chunked_oversize_body_status(deployment: Deployment, headers: dict) -> int:
    """A chunked body with no declared length is cut off once it passes the limit."""
    host, port = deployment.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    chunk = b" " * (1 << 20)
    body = iter([b'{"model": "' + MODEL.encode() + b'", "prompt": "hi"', *([chunk] * 5), b"}"])
    conn.request("POST", "/v1/completions", body=body, headers={**headers, "content-type": "application/json"},
                 encode_chunked=True)
    status = conn.getresponse().status
    conn.close()
    return status


def test_a_frontend_without_workers_answers_503_and_is_not_ready(tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dynamo_pd.frontend", "--port", str(port),
                             "--discovery", f"tcp://127.0.0.1:{free_port()}"],
                            stdout=open(tmp_path / "frontend.log", "wb"), stderr=subprocess.STDOUT)
    deployment = Deployment(url=f"http://127.0.0.1:{port}", procs={"frontend": proc}, logs=tmp_path)
    try:
        deployment.wait_for(lambda: _answers(deployment), 60, "frontend up")
        assert deployment.get("/ready")[0] == 503
        status, body = deployment.get("/v1/models")  # no model is served until a worker serves it
        assert status == 503 and b"no workers ready" in body
        status, body = deployment.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
        # the gateway serves the models its workers register: none yet
        assert (
            status == 404 and body["error"]["code"] == "model_not_found" and "none yet" in body["error"]["message"]
        ), body
    finally:
        assert deployment.stop() == {"frontend": 0}


def _answers(deployment: Deployment) -> bool:
    try:
        return deployment.get("/health")[0] == 200
    except OSError:
        return False


@pytest.mark.parametrize("handoff", ["pull", "push"])
def test_killing_the_prefill_worker_mid_request_falls_back_to_local_prefill(tmp_path, openai_client_factory, handoff):
    deployment = start_deployment(tmp_path, "--prefill", "1", "--decode", "1", "--kv-handoff", handoff)
    try:
        client = openai_client_factory(deployment)
        # ~1100 tokens: seconds of prefill on this CPU, far inside the 60 s first-response bound even when
        # the machine is loaded (4900 tokens took over 60 s there, and the fallback as long again)
        prompt = "Summarise this. " + " ".join(f"item{i}" for i in range(300))
        expected = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
        deployment.wait_for(lambda: deployment.metric("dynamo_pd_worker_running_requests", worker="prefill-0") == 0,
                            60, "the first request gone from the prefill worker's load report")
        result: dict = {}

        def request() -> None:
            try:  # shares no prefix with `prompt`: its prefill computes ~1500 tokens, seconds on this CPU
                result["text"] = client.completions.create(
                    model=MODEL, prompt="Now this. " + " ".join(f"entry{i}" for i in range(400)), max_tokens=8,
                    temperature=0).choices[0].text
            except Exception as exc:  # noqa: BLE001 - the test inspects what the client saw
                result["error"] = exc

        thread = threading.Thread(target=request)
        thread.start()
        # The frontend holds the request and has no first token yet: whether the prefill worker has it queued,
        # is computing it, or has not yet been sent it, killing the worker now must end in a local prefill
        # (the prefill_failed fallback asserted below; a kill after the first token would be transfer_failed).
        deployment.wait_for(lambda: deployment.metric("dynamo_pd_queued_requests") == 1, 60, "request routed")
        deployment.procs["prefill-0"].kill()
        thread.join(90)
        assert not thread.is_alive(), "the request hung after its prefill worker died"
        assert "text" in result, result
        assert deployment.metric("dynamo_pd_prefill_fallbacks_total", reason="prefill_failed") >= 1
        # later requests keep working on the decode worker alone
        again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
        assert again == expected
    finally:
        codes = deployment.stop()
    assert codes["frontend"] == 0 and codes["decode-0"] == 0, codes


def test_an_aggregated_worker_killed_before_its_first_token_gives_a_clear_503(tmp_path):
    deployment = start_deployment(tmp_path, "--aggregated", "1")
    try:
        prompt = "Summarise this. " + " ".join(f"item{i}" for i in range(1500))
        result: dict = {}
        thread = threading.Thread(target=lambda: result.update(answer=deployment.post(
            "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 8})))
        thread.start()
        deployment.wait_for(lambda: deployment.metric("dynamo_pd_queued_requests") == 1, 20, "request in prefill")
        deployment.procs["aggregated-0"].kill()
        thread.join(30)
        assert not thread.is_alive(), "the request hung after its worker died"
        status, body = result["answer"]
        assert status == 503 and body["error"]["code"] == "worker_unavailable", body
    finally:
        codes = deployment.stop()
    assert codes["frontend"] == 0, codes
    assert "Traceback" not in (tmp_path / "frontend.log").read_text()


def test_two_frontends_on_one_namespace_share_their_routers_load(tmp_path, etcd_url):
    """Frontends behind a load balancer: each one's placements reach the other's router."""
    deployment = start_deployment(tmp_path, "--aggregated", "1", "--etcd", etcd_url)
    port = free_port()
    with open(tmp_path / "frontend-b.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "dynamo_pd.frontend", "--port", str(port), "--discovery",
                                 etcd_url, "--namespace", deployment.namespace], stdout=log, stderr=subprocess.STDOUT)
    second = Deployment(url=f"http://127.0.0.1:{port}", procs={"frontend-b": proc}, logs=tmp_path)
    try:
        second.wait_for(lambda: workers_registered(second) == 1, 120, "the second frontend found the worker")
        for sender, receiver in ((deployment, second), (second, deployment)):
            def shared() -> bool:  # ZMQ drops updates sent before the receiver's subscription forms
                status, _ = sender.post("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
                assert status == 200
                return receiver.rendered_metric("dynamo_pd_router_replica_updates") >= 2  # placed, finished
            receiver.wait_for(shared, 60, "load updates shared between the frontends")
            assert receiver.rendered_metric("dynamo_pd_router_replica_expired") == 0  # every finish arrived
    finally:
        codes = second.stop() | deployment.stop()
    assert codes == {"frontend-b": 0, "frontend": 0, "aggregated-0": 0}, codes
    assert "Traceback" not in (tmp_path / "frontend-b.log").read_text()


def test_a_killed_worker_leaves_the_pool_through_its_etcd_lease(tmp_path, etcd_url, nats_url):
    deployment = start_deployment(tmp_path, "--prefill", "1", "--decode", "1", "--etcd", etcd_url, "--nats", nats_url)
    try:
        assert deployment.get("/ready")[0] == 200
        assert deployment.rendered_metric("dynamo_pd_worker_total_blocks", worker="decode-0") > 0
        deployment.procs["decode-0"].kill()
        deployment.wait_for(lambda: deployment.get("/ready")[0] == 503, 15, "decode worker dropped from discovery")
        assert deployment.metric("dynamo_pd_worker_total_blocks", worker="decode-0") is None  # forgotten
        assert deployment.rendered_metric("dynamo_pd_worker_total_blocks", worker="prefill-0") > 0
    finally:
        codes = deployment.stop()
    assert codes["frontend"] == 0 and codes["prefill-0"] == 0, codes


@pytest.mark.nixl
@pytest.mark.parametrize("handoff", ["pull", "push"])
def test_a_failed_kv_transfer_falls_back_to_prefill_on_the_decode_worker(tmp_path, aggregated,
                                                                         openai_client_factory, handoff):
    pytest.importorskip("nixl", reason="NIXL is not installed (pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1)")
    # Misconfigured transports (prefill ZMQ, decode NIXL): every hand-off fails, clearly, on both sides.
    deployment = start_deployment(tmp_path, "--prefill", "1", "--decode", "1", "--kv-handoff", handoff,
                                  worker_args={"decode-0": ["--kv-transport", "nixl"]})
    try:
        client = openai_client_factory(deployment)
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}],
                                                temperature=0, max_tokens=32, stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reference = openai_client_factory(aggregated, API_KEY).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}], temperature=0, max_tokens=32)
        assert text == reference.choices[0].message.content
        # the fallback re-prefills prompt + first token; usage still describes the request as sent
        assert chunks[-1].usage.prompt_tokens == reference.usage.prompt_tokens
        assert chunks[-1].usage.completion_tokens == reference.usage.completion_tokens
        assert deployment.metric("dynamo_pd_prefill_fallbacks_total", reason="transfer_failed") >= 1
        logs = "".join((tmp_path / f"{name}.log").read_text() for name in ("frontend", "prefill-0"))
        assert "descriptor uses" in logs, "the mismatch is named"
        workers = ("prefill-0", "decode-0")
        deployment.wait_for(lambda: all(
            deployment.rendered_metric("dynamo_pd_worker_free_blocks", worker=w)
            == deployment.rendered_metric("dynamo_pd_worker_total_blocks", worker=w) for w in workers), 15,
            "blocks freed")
    finally:
        codes = deployment.stop()
    assert all(code == 0 for code in codes.values()), codes
