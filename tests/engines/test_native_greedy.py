"""Greedy output of the native engine equals transformers' greedy `generate`, token for token."""

from __future__ import annotations

import pytest
import torch

from dynamo_pd.llm import LLM
from dynamo_pd.model_store import resolve_model
from dynamo_pd.protocol import SamplingParams, StopConditions

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def branch_ids(prompt_ids):
    """The longest prompt with a different ending: shares its leading full blocks with it."""
    return prompt_ids[3][:40] + prompt_ids[1][:9]


@pytest.fixture(scope="module")
def hf_greedy(prompt_ids, branch_ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(resolve_model(None)), dtype=torch.float32)
    refs = []
    for ids in [*prompt_ids, branch_ids]:
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=MAX_TOKENS, do_sample=False)
        refs.append(out[0, len(ids):].tolist())
    return refs


@pytest.mark.parametrize("engine_config", [
    pytest.param(dict(max_num_batched_tokens=2048), id="whole-prompts"),
    pytest.param(dict(max_num_batched_tokens=13), id="chunked-prefill"),
    pytest.param(dict(max_num_batched_tokens=2048, enable_prefix_caching=False), id="no-prefix-cache"),
])
def test_greedy_matches_transformers(engine_config, prompt_ids, branch_ids, hf_greedy):
    llm = LLM(num_kv_blocks=64, **engine_config)
    stop = StopConditions(max_tokens=MAX_TOKENS)
    first = llm.generate(prompt_ids, GREEDY, stop)
    assert [r.token_ids for r in first] == hf_greedy[:-1]
    for r in first:
        assert r.text == llm.tokenizer.decode(r.token_ids, skip_special_tokens=True)
        assert r.finish_reason == ("stop" if r.token_ids[-1] in llm.core.eos_token_ids else "length")
        assert r.usage.cached_tokens == 0

    # Again, plus a prompt sharing only a prefix: answers come (partly) from the prefix cache.
    second = llm.generate([*prompt_ids, branch_ids], GREEDY, stop)
    assert [r.token_ids for r in second] == hf_greedy
    caching = engine_config.get("enable_prefix_caching", True)
    bs = llm.core.block_manager.block_size
    for r, ids in zip(second[:-1], prompt_ids):
        full_blocks = (len(ids) - 1) // bs  # the last prompt token is always computed
        assert r.usage.cached_tokens == (full_blocks * bs if caching else 0)
    assert second[-1].usage.cached_tokens == (40 // bs * bs if caching else 0)
    assert llm.core.block_manager.num_free_blocks == llm.core.block_manager.num_blocks
