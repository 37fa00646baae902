"""Tracing (dynamo_pd.tracing) in one process: a real frontend (its HTTP server, router and RPC client), a
mocker prefill worker and two mocker decode workers handing KV over through kv_transfer, and the SDK's
OTLP/HTTP exporter posting into a receiver this test runs (benchmarks/otlp_receiver.py decodes the wire
with opentelemetry.proto). One decode worker's RPC server closes mid-stream, as a dead process's does:
every request still yields one connected trace holding admission, routing, the prefill, the KV transfer,
the decode and the migration. tests/e2e/test_tracing_e2e.py does the same with a process per worker and
SIGKILL. Also here: the flags, sampling, W3C continuation, the RPC metadata, and that tracing off
imports nothing of OpenTelemetry."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import msgspec
import pytest

from benchmarks.otlp_receiver import OtlpReceiver, Span
from dynamo_pd import tracing
from dynamo_pd.engines.base import EngineRole
from dynamo_pd.frontend import __main__ as frontend
from dynamo_pd.runtime import RequestContext, RpcClient, RpcServer
from dynamo_pd.runtime import rpc_wire
from dynamo_pd.runtime.ports import free_port
from dynamo_pd.runtime.tasks import cancel_and_wait
from dynamo_pd.worker import Worker, parse_args as worker_args
from router.hashing import block_hashes
from router.service import KvRouter, RouterConfig
from router.worker import Role
from tests.waits import until

MODEL = "SmolLM2-135M-Instruct"
PROMPT = [1000 + 7 * i for i in range(200)]  # token ids: 12 full blocks of 16
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def fast_export(monkeypatch):
    """The SDK's batch processor sends every 100 ms instead of 5 s (the test waits for the spans)."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    yield
    tracing.shutdown()


async def _get(client: httpx.AsyncClient, path: str) -> httpx.Response | None:
    try:
        return await client.get(path)
    except httpx.HTTPError:  # not listening yet
        return None


class Stack:
    """A frontend (python -m dynamo_pd.frontend's run()) and in-process mocker workers on one event loop."""

    def __init__(self, *flags: str, kv_handoff: str = "pull"):
        self.port, discovery = free_port(), f"tcp://127.0.0.1:{free_port()}"
        self.args = frontend.parse_args(["--port", str(self.port), "--discovery", discovery, *flags])
        self.common = ["--engine", "mocker", "--discovery", discovery, "--speedup", "0.5", "--kv-handoff",
                       kv_handoff, *flags]
        self.workers: dict[str, Worker] = {}
        self.url = f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> Stack:
        self.frontend = asyncio.create_task(frontend.run(self.args))
        try:
            for role, worker_id in ((EngineRole.PREFILL, "prefill-0"), (EngineRole.DECODE, "decode-0"),
                                    (EngineRole.DECODE, "decode-1")):
                worker = Worker(worker_args(role, [*self.common, "--worker-id", worker_id]))
                self.workers[worker_id] = worker
                await worker.start()
            async with httpx.AsyncClient(base_url=self.url, timeout=10) as client:
                async def routed() -> bool:
                    response = await _get(client, "/metrics")
                    return response is not None and response.text.count("dynamo_pd_worker_total_blocks{") == 3
                await until(routed, "the frontend routes to all three workers", 60, poll_s=0.1)
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc_info) -> None:
        for worker in self.workers.values():
            await worker.stop()
        if self.frontend.done():
            self.frontend.result()
            return
        async with httpx.AsyncClient(base_url=self.url, timeout=5) as client:
            serving = await _get(client, "/health") is not None
        if serving:  # its signal handlers are in place: SIGTERM stops it as it stops the process
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.wait_for(self.frontend, 60)
        else:
            await cancel_and_wait([self.frontend])


async def stream(client: httpx.AsyncClient, headers: dict, placed: asyncio.Future | None = None,
                 resume: asyncio.Event | None = None) -> dict:
    """A streamed completion: its id, the worker header, the client's TTFT and its text. After 3 chunks it
    sets `placed` to the worker streaming it and waits for `resume` (the test kills a worker meanwhile)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "stream": True}
    sent = time.perf_counter()
    ttft, text, chunks, rid = None, "", 0, None
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        worker = response.headers["x-dynamo-pd-worker"]
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            rid = chunk["id"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                ttft = ttft if ttft is not None else time.perf_counter() - sent
                text += chunk["choices"][0]["text"]
                chunks += 1
                if chunks == 3 and placed is not None:
                    placed.set_result(worker)
                    await asyncio.wait_for(resume.wait(), 60)
    return {"id": rid, "worker": worker, "ttft_s": ttft, "text": text}


def by_name(spans: list[Span], name: str) -> list[Span]:
    return sorted((s for s in spans if s.name == name), key=lambda s: s.start_ns)


def children(spans: list[Span], parent: Span, name: str) -> list[Span]:
    return [s for s in by_name(spans, name) if s.parent_span_id == parent.span_id]


def check_trace(spans: list[Span], result: dict, migrated: str | None, continued: bool, handoff: str) -> None:
    """One connected trace for the request: the spans of the issue, in their places."""
    [request] = [s for s in by_name(spans, "request") if s.attributes["dynamo_pd.request_id"] == result["id"]]
    trace = [s for s in spans if s.trace_id == request.trace_id]
    ids = {s.span_id for s in trace}
    assert request.parent_span_id == (CLIENT_SPAN if continued else ""), request
    assert all(s.parent_span_id in ids for s in trace if s is not request), "a span whose parent is elsewhere"
    assert request.attributes["http.response.status_code"] == 200 and request.status_code != 2
    [admission] = children(trace, request, "admission")
    assert admission.attributes["dynamo_pd.prompt_tokens"] == len(PROMPT)
    assert admission.end_ns <= (first := children(trace, request, "first_token")[0]).start_ns
    # the trace's time to the first token lies within the client's (which began before and ended after it); on
    # one event loop with the workers the client's is late by their steps: e2e checks the two within 5%
    assert 0 < (first.start_ns - request.start_ns) / 1e9 <= result["ttft_s"]
    [attempt] = children(trace, request, "attempt")
    [route] = children(trace, attempt, "route")
    a = route.attributes
    assert sorted(a["dynamo_pd.route.decode.candidates"]) == ["decode-0", "decode-1"]
    assert a["dynamo_pd.route.decode.worker"] in a["dynamo_pd.route.decode.candidates"]
    assert a["dynamo_pd.route.prefill.candidates"] == ["prefill-0"] and a["dynamo_pd.route.policy"] == "time"
    costs = a["dynamo_pd.route.decode.candidate_costs"]  # predicted seconds: the chosen one's is the least
    assert a["dynamo_pd.route.decode.predicted_cost"] == min(costs) >= 0
    assert len(a["dynamo_pd.route.prefill.candidate_overlap_blocks"]) == 1
    [prefill] = children(trace, attempt, "prefill")
    assert prefill.attributes["dynamo_pd.worker_id"] == "prefill-0"
    assert prefill.attributes["dynamo_pd.prompt_tokens"] == len(PROMPT)
    # pull: the prefill holds the prompt's blocks (the last one partial) until the decode side read them;
    # push: it writes them into the blocks the decode side reserved
    [hold] = children(trace, attempt, "kv_hold" if handoff == "pull" else "kv_push")
    assert hold.attributes["dynamo_pd.kv.blocks"] == -(-len(PROMPT) // 16)
    [decode] = children(trace, attempt, "decode")
    assert decode.attributes["dynamo_pd.worker_id"] == a["dynamo_pd.route.decode.worker"]
    [transfer] = children(trace, decode, "kv_transfer")
    t = transfer.attributes
    assert (t["dynamo_pd.kv.transport"], t["dynamo_pd.kv.mode"]) == ("zmq", handoff)
    assert t["dynamo_pd.kv.blocks"] >= 1 and t["dynamo_pd.kv.bytes"] > 0
    assert t["dynamo_pd.kv.gb_per_s"] == pytest.approx(
        t["dynamo_pd.kv.bytes"] / t["dynamo_pd.kv.seconds"] / 1e9)
    if handoff == "pull":
        assert prefill.start_ns <= hold.start_ns <= transfer.start_ns <= hold.end_ns
    else:  # timed from the prefill's stamp as it wrote, to the decode side's receipt
        assert hold.start_ns <= transfer.start_ns <= transfer.end_ns
        assert hold.attributes["dynamo_pd.kv.bytes"] > 0
    # the client's first token is the prefill's, sent on while the decode side reads the KV
    assert prefill.end_ns <= first.start_ns and prefill.end_ns <= transfer.start_ns
    moves = by_name(trace, "migration")
    if migrated is None:
        assert not moves and not by_name(trace, "retry") and attempt.status_code != 2
        return
    assert attempt.status_code == 2 and decode.attributes["dynamo_pd.worker_id"] == migrated
    [move] = moves
    assert move.parent_span_id == request.span_id and move.start_ns >= first.start_ns
    assert move.attributes["dynamo_pd.reason"] == "worker_gone"
    assert move.attributes["dynamo_pd.failed_worker"] == migrated
    assert move.attributes["dynamo_pd.tokens_sent"] >= 3
    [again] = children(trace, move, "route")
    assert again.attributes["dynamo_pd.route.decode.candidates"] == [w for w in ("decode-0", "decode-1")
                                                                     if w != migrated]
    [resumed] = children(trace, move, "decode")
    assert resumed.attributes["dynamo_pd.worker_id"] != migrated
    assert resumed.attributes["dynamo_pd.resume_tokens"] == move.attributes["dynamo_pd.tokens_sent"]
    assert resumed.end_ns <= request.end_ns


@pytest.mark.parametrize("handoff", ["pull", "push"])
async def test_every_request_is_one_connected_trace_through_a_migration(fast_export, handoff):
    with OtlpReceiver() as receiver:
        async with Stack("--otlp-endpoint", receiver.endpoint, kv_handoff=handoff) as stack:
            async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
                await stream(client, {})  # warm: the workers report their step costs
                loop = asyncio.get_running_loop()
                placed = [loop.create_future() for _ in range(3)]
                resume = asyncio.Event()
                headers = [{"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}, {"x-request-id": "client-7"}, {}]
                tasks = [asyncio.create_task(stream(client, h, p, resume)) for h, p in zip(headers, placed)]
                workers = await asyncio.wait_for(asyncio.gather(*placed), 60)  # every stream is 3 chunks in
                victim = workers[0]
                await stack.workers[victim]._rpc.close()  # its connections drop, as a dead process's do
                resume.set()
                results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        spans = receiver.wait_for(lambda spans: len(by_name(spans, "request")) == 4, 30)
    continued = {s.trace_id for s in by_name(spans, "request") if s.parent_span_id == CLIENT_SPAN}
    assert continued == {CLIENT_TRACE}
    assert len({s.trace_id for s in spans if s.name == "request"}) == 4  # the warm-up's, and one each
    for i, (result, worker) in enumerate(zip(results, workers)):
        check_trace(spans, result, victim if worker == victim else None, i == 0, handoff)
    # the client's X-Request-ID finds its request's trace
    tagged = [s for s in by_name(spans, "request") if "http.request.header.x-request-id" in s.attributes]
    assert [(s.attributes["http.request.header.x-request-id"], s.attributes["dynamo_pd.request_id"])
            for s in tagged] == [(["client-7"], results[1]["id"])]


# ---- off, flags and the one-line errors

def _child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)


def test_tracing_off_imports_nothing_of_opentelemetry():
    """Off (no --otlp-endpoint): the frontend's, workers' and launcher's modules and a request's calls into
    dynamo_pd.tracing load no OpenTelemetry module (the serve-only install has none)."""
    done = _child("""
import sys
import dynamo_pd.frontend.__main__ as frontend, dynamo_pd.frontend.app, dynamo_pd.frontend.backend
import dynamo_pd.worker as worker, dynamo_pd.mocker, dynamo_pd.serve as serve, dynamo_pd.handoff
from dynamo_pd import tracing
from dynamo_pd.engines.base import EngineRole
args = frontend.parse_args([])
assert args.tracing == tracing.TracingConfig() and not serve.parse_args([])[0].tracing.endpoint
assert worker.parse_args(EngineRole.DECODE, ["--engine", "mocker"]).tracing == tracing.TracingConfig()
tracing.setup(args.tracing, "dynamo-pd-frontend")
span = tracing.request_span({"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
assert span is tracing.NOOP and tracing.carrier(span) == {} and tracing.under(span) is None
assert tracing.extract({"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}) is None
assert tracing.start("route", None) is tracing.NOOP
tracing.end(span, "x")
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")
assert not loaded, loaded
print("clean")
""")
    assert done.returncode == 0 and done.stdout.strip() == "clean", done.stderr[-3000:]


def test_flags_are_checked_before_anything_starts():
    for argv, error in ((["--trace-sample-ratio", "1.5"], "--trace-sample-ratio must be in [0, 1]"),
                        (["--otlp-endpoint", "127.0.0.1:4317"], "--otlp-endpoint must be an OTLP/HTTP URL")):
        done = _child(f"from dynamo_pd.frontend.__main__ import parse_args; parse_args({argv!r})")
        assert done.returncode == 2 and error in done.stderr, done.stderr[-2000:]
    # serve hands the flags to the frontend and to every worker
    from dynamo_pd.serve import parse_args, plan
    options, engine_argv = parse_args(["--engine", "mocker", "--otlp-endpoint", "http://collector:4318",
                                       "--trace-sample-ratio", "0.1"])
    for command in plan(options, engine_argv)[1]:
        at = command.index("--otlp-endpoint")
        assert command[at:at + 4] == ["--otlp-endpoint", "http://collector:4318",
                                      "--trace-sample-ratio", "0.1"]
    assert tracing.TracingConfig("http://collector:4318/").traces_url == "http://collector:4318/v1/traces"
    assert tracing.TracingConfig("https://c.example/otlp/v1/traces").traces_url == "https://c.example/otlp/v1/traces"


def test_an_endpoint_without_the_packages_is_one_line_naming_the_extra():
    """As in an install without the [tracing] extra: OpenTelemetry cannot be imported in this child."""
    done = _child("""
import sys
class NoOpenTelemetry:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "opentelemetry":
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, NoOpenTelemetry())
from dynamo_pd.frontend.__main__ import parse_args
parse_args(["--otlp-endpoint", "http://127.0.0.1:4318"])
""")
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "--otlp-endpoint needs OpenTelemetry" in last and "pip install 'dynamo-pd[tracing]'" in last, last
    assert "Traceback" not in done.stderr


# ---- sampling and W3C continuation, exported over the wire

def test_sampling_ratio_and_the_clients_traceparent(fast_export):
    with OtlpReceiver() as receiver:
        tracing.setup(tracing.TracingConfig(receiver.endpoint, 0.1), "dynamo-pd-frontend")
        sampled = [tracing.request_span({}) for _ in range(2000)]
        recorded = [s for s in sampled if s is not tracing.NOOP]
        assert 130 <= len(recorded) <= 270  # 10% of 2000, within 5 standard deviations (13.4)
        continued = tracing.request_span({"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})  # sampled
        declined = tracing.request_span({"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"})  # not sampled
        assert declined is tracing.NOOP and tracing.carrier(declined) == {}
        carrier = tracing.carrier(continued)
        traceparent = carrier["traceparent"]
        assert traceparent.startswith(f"00-{CLIENT_TRACE}-") and traceparent.endswith("-01")
        child = tracing.start("decode", tracing.extract(carrier))  # as a worker continues it
        for span in [*recorded, child, continued]:
            tracing.end(span)
        tracing.shutdown()  # exports what is queued
        spans = receiver.wait_for(lambda spans: len(spans) == len(recorded) + 2, 30)
    [request] = [s for s in spans if s.trace_id == CLIENT_TRACE and s.name == "request"]
    [decode] = [s for s in spans if s.trace_id == CLIENT_TRACE and s.name == "decode"]
    assert request.parent_span_id == CLIENT_SPAN and decode.parent_span_id == request.span_id
    assert {s.service for s in spans} == {"dynamo-pd-frontend"}


# ---- the request plane carries the metadata

async def test_rpc_metadata_reaches_the_handlers_context_and_is_not_on_the_wire_when_empty():
    seen: dict[str, dict[str, str]] = {}

    async def handler(payload: bytes, context: RequestContext):
        seen[context.request_id] = context.metadata
        yield payload

    carrier = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "tracestate": "vendor=1"}
    async with RpcServer(handler) as server:
        client = RpcClient()
        try:
            for rid, metadata in (("traced", carrier), ("plain", None)):
                context = RequestContext(rid, metadata)
                assert [c async for c in client.stream(server.endpoint, b"x", context)] == [b"x"]
        finally:
            await client.close()
    assert seen == {"traced": carrier, "plain": {}}
    plain = msgspec.msgpack.decode(rpc_wire.encoder.encode(rpc_wire.Open(1, "plain")))
    assert "metadata" not in plain  # an untraced call's frame is what it was before tracing


# ---- the router explains its choice when asked

def test_place_explains_the_candidates_and_their_predicted_costs_only_when_asked():
    router = KvRouter(RouterConfig(seed=0))
    for worker_id in ("p0", "p1", "d0", "d1"):
        role = Role.PREFILL if worker_id.startswith("p") else Role.DECODE
        router.add_worker(worker_id, role, capacity_blocks=100, block_size=4)
    tokens = list(range(40))
    router.indexer.store("p1", block_hashes(tokens, 4))  # p1 holds the whole prompt
    plain = router.place("plain", tokens)
    assert plain.prefill.candidates == () and plain.decode.candidates == ()
    plain.finished()
    placement = router.place("r", tokens, explain=True)
    prefill = {c.worker_id: c for c in placement.prefill.candidates}
    assert placement.prefill.worker_id == "p1"
    assert (prefill["p0"].overlap_blocks, prefill["p1"].overlap_blocks) == (0, 10)
    assert 0 < prefill["p1"].cost < prefill["p0"].cost  # the time policy's predicted seconds: less to compute
    assert {c.worker_id for c in placement.decode.candidates} == {"d0", "d1"}
    kv = KvRouter(RouterConfig(policy="kv", seed=0))
    kv.add_worker("a0", Role.AGGREGATED, capacity_blocks=100, block_size=4)
    [scored] = kv.place("r", tokens, explain=True).decode.candidates
    assert scored.cost == 10 + 10  # overlap_weight 1 * 10 prefill blocks + 10 active blocks
    rr = KvRouter(RouterConfig(policy="round_robin"))
    rr.add_worker("a0", Role.AGGREGATED, capacity_blocks=100, block_size=4)
    assert rr.place("r", tokens, explain=True).decode.candidates[0].cost is None
