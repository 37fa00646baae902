"""Migration inside the native engine: a request cut after k streamed outputs and resumed on another
engine with those k tokens (EngineRequest.resume_token_ids) streams exactly the rest of what one
engine streams: text under stop strings (holdback across the cut), tokens, seeded samples with
penalties, and usage of the whole request."""

from __future__ import annotations

import msgspec
import pytest

from dynamo_pd.engines.base import EngineConfig, EngineRole
from dynamo_pd.engines.native.core import EngineCore
from dynamo_pd.protocol import EngineRequest, InvalidRequestError, SamplingParams, StopConditions
from tests.engines.test_native_continuation import PROMPTS, run, stop_cases, summary


@pytest.fixture(scope="module")
def cores():
    return {role: EngineCore(EngineConfig(role=role, num_kv_blocks=96)) for role in EngineRole}


def resumed(core: EngineCore, request: EngineRequest, expected_outs, k: int) -> dict:
    """The first k outputs as the failed worker streamed them, then the resuming engine's."""
    head = expected_outs[:k]
    tokens = [t for o in head for t in o.token_ids]
    rest = run(core, msgspec.structs.replace(request, request_id=f"{request.request_id}-m",
                                             resume_token_ids=tokens))
    return summary([*head, *rest])


@pytest.mark.slow
def test_a_resumed_request_streams_the_rest_of_the_unfailed_text(cores):
    agg = cores[EngineRole.AGGREGATED]
    cases = [(p, s) for p, s in stop_cases(cores, agg.tokenizer) if s.max_tokens > 1]
    checked = 0
    for i, (prompt, stop) in enumerate(cases):
        request = EngineRequest(request_id=f"case{i}", prompt_token_ids=agg.tokenizer.encode(prompt),
                                sampling=SamplingParams(temperature=0), stop=stop)
        outs = run(agg, request)
        expected = summary(outs)
        for k in range(1, len(outs)):  # every cut before the last output
            assert resumed(agg, request, outs, k) == expected, (prompt, stop, k)
            checked += 1
    assert checked > len(cases)
    assert not agg.seqs and agg.block_manager.num_free_blocks == agg.block_manager.num_blocks


@pytest.mark.slow
def test_seeded_sampling_with_penalties_resumes_with_the_draws_the_unfailed_run_makes(cores):
    agg = cores[EngineRole.AGGREGATED]
    for i, prompt in enumerate(PROMPTS[:2]):
        request = EngineRequest(request_id=f"seeded{i}", prompt_token_ids=agg.tokenizer.encode(prompt),
                                sampling=SamplingParams(temperature=0.9, seed=7, frequency_penalty=0.5),
                                stop=StopConditions(max_tokens=10, ignore_eos=True))
        outs = run(agg, request)
        for k in (1, 4, 9):
            assert resumed(agg, request, outs, k) == summary(outs), (prompt, k)


def test_a_resume_that_leaves_no_tokens_is_refused(cores):
    agg = cores[EngineRole.AGGREGATED]
    request = EngineRequest(request_id="full", prompt_token_ids=[1, 2, 3], stop=StopConditions(max_tokens=2),
                            resume_token_ids=[5, 6])
    with pytest.raises(InvalidRequestError, match="leave none of max_tokens"):
        agg.add_request(request)
