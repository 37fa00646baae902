"""The native engine's whole-model bfloat16 path (the README's bfloat16 throughput) against transformers
in bfloat16, greedy, on the shared prompts.

bfloat16 keeps 8 bits of mantissa, so two correct implementations that round at different points
(transformers rounds the normalized row before the norm weight and rotates in bfloat16; the native kernels
do both in float32 and round once) part ways at near-ties and then follow different texts: the common
greedy prefix is a poor measure (measured 17 / 22 / 28 / 11 tokens of 32 on the four prompts). Instead
transformers reads the native engine's answer teacher-forced: at every position its greedy choice is
compared with the native one, and both bfloat16 log-probabilities with transformers' float32 ones, which
tells a precision loss from a different rounding order."""

from __future__ import annotations

import pytest
import torch

from dynamo_pd.llm import LLM
from dynamo_pd.protocol import SamplingParams, StopConditions

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
# Measured (2-core AVX2 host, no AVX512-BF16: the bfloat16 matmuls are torch's, the kernels' arithmetic
# float32): 92 of 96 positions agree (0.958; transformers' bfloat16 agrees with its own float32 at 91), each
# disagreement a near-tie transformers scores 0.0 to 0.375 nats apart (its bfloat16 logits step by 0.125).
# Against transformers in float32 the native engine's log-probability of its token is off by 0.026 nats on
# average, as much as transformers' bfloat16 is (0.026); with the kernels rounding bfloat16 by truncation
# instead of to nearest it was 0.081 against 0.024, while agreement (0.927) and gaps (<= 0.5) stayed within
# the first two bounds.
MIN_TOP1_AGREEMENT = 0.9
MAX_NEAR_TIE_GAP = 0.5
MAX_ERROR_VS_TRANSFORMERS_BF16 = 1.5  # times transformers' own bfloat16 error, both against float32


def _logprobs(model, prompt_ids: list[list[int]], results) -> list[torch.Tensor]:
    """For each prompt, [answer tokens, vocab]: the model's log-probabilities for each token of the native
    engine's answer, teacher-forced on the prompt and the answer before it."""
    out = []
    for ids, result in zip(prompt_ids, results):
        with torch.inference_mode():
            logits = model(torch.tensor([ids + result.token_ids])).logits[0, len(ids) - 1:-1]
        out.append(torch.log_softmax(logits.float(), dim=-1))
    return out


def test_bf16_agrees_with_transformers_bf16_and_is_as_precise(model_dir, prompt_ids):
    from transformers import AutoModelForCausalLM

    llm = LLM(model=str(model_dir), dtype="bfloat16", num_kv_blocks=64)
    assert llm.core.kv_cache.dtype == torch.bfloat16
    # ignore_eos: every prompt gives MAX_TOKENS positions to compare
    results = llm.generate(prompt_ids, SamplingParams(temperature=0, logprobs=0),
                           StopConditions(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert all(len(r.token_ids) == MAX_TOKENS for r in results)
    hf_bf16, hf_fp32 = (
        _logprobs(AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype), prompt_ids, results)
        for dtype in (torch.bfloat16, torch.float32))

    agree, gaps, native_error, hf_bf16_error = 0, [], 0.0, 0.0
    for result, bf16_rows, fp32_rows in zip(results, hf_bf16, hf_fp32):
        for token, native, bf16, fp32 in zip(result.token_ids, result.logprobs, bf16_rows, fp32_rows):
            best = int(bf16.argmax())
            agree += best == token
            if best != token:
                gaps.append(round(float(bf16[best] - bf16[token]), 3))
            native_error += abs(native.logprob - float(fp32[token]))
            hf_bf16_error += abs(float(bf16[token] - fp32[token]))

    total = len(prompt_ids) * MAX_TOKENS
    assert agree / total >= MIN_TOP1_AGREEMENT, f"{agree} of {total} greedy choices agree"
    assert all(gap <= MAX_NEAR_TIE_GAP for gap in gaps), f"disagreements, no near-tie (nats): {gaps}"
    assert native_error <= MAX_ERROR_VS_TRANSFORMERS_BF16 * hf_bf16_error, (
        f"bfloat16 log-probabilities {native_error / total:.3f} nats from float32 on average, "
        f"transformers' {hf_bf16_error / total:.3f}")
