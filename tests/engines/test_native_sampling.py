"""Sampling: the sampler on synthetic logits, the detokenizer, and sampling options end to end."""

from __future__ import annotations

import math

import pytest
import torch

from dynamo_pd.engines.native.detokenizer import IncrementalDetokenizer
from dynamo_pd.engines.native.sampler import sample
from dynamo_pd.engines.native.sequence import Sequence
from dynamo_pd.protocol import EngineRequest, SamplingParams, StopConditions

VOCAB = 16


def seq_with(prompt: list[int], output: list[int] = (), **sampling) -> Sequence:
    params = SamplingParams(**sampling)
    seq = Sequence(request=EngineRequest(request_id="r", prompt_token_ids=prompt, sampling=params),
                   block_size=16, detokenizer=IncrementalDetokenizer(None, prompt, []),
                   generator=None if params.seed is None else torch.Generator().manual_seed(params.seed))
    seq.token_ids += list(output)
    return seq


def logits_for(*rows: list[float]) -> torch.Tensor:
    out = torch.full((len(rows), VOCAB), -5.0)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row)
    return out


def draw(logits: torch.Tensor, seqs: list[Sequence], seed: int = 0) -> list[int]:
    return sample(logits, seqs, torch.Generator().manual_seed(seed))[0]


def test_greedy_and_top_k_1_pick_the_argmax():
    logits = logits_for([0.1, 3.0, 2.9], [2.0, 0.0, 5.0])
    assert draw(logits, [seq_with([1], temperature=0), seq_with([1], temperature=0)]) == [1, 2]
    for seed in range(20):
        assert draw(logits, [seq_with([1], temperature=1.5, top_k=1)] * 2, seed) == [1, 2]


def test_a_temperature_too_small_to_divide_by_is_greedy():
    """Logits over 1e-300 overflow to inf and softmax to NaN, which picked the last token (schemathesis found it
    under a grammar, where that token was one the grammar forbids); below 1e-5 is greedy, as in vLLM."""
    logits = logits_for([0.1, 3.0, 2.9], [2.0, 0.0, 5.0])
    for temperature in (1e-300, 5e-324, 1e-6):
        for top_p in (1.0, 0.5):
            assert draw(logits.clone(), [seq_with([1], temperature=temperature, top_p=top_p)] * 2) == [1, 2]


def test_seeded_rows_repeat_whatever_shares_the_batch():
    logits = logits_for([1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0])
    runs = [draw(logits[:1], [seq_with([1], seed=7)])[0] for _ in range(3)]
    alone = [draw(logits[:1], [seq_with([1], seed=s)])[0] for s in range(30)]
    beside = [draw(logits, [seq_with([1]), seq_with([1], seed=s)], seed=s + 100)[1] for s in range(30)]
    assert len(set(runs)) == 1
    assert alone == beside
    assert len(set(alone)) > 1, "different seeds should not all agree"


def test_temperature_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = torch.full((1, VOCAB), -math.inf)
    logits[0, :3] = probs.log()
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(3)
    for _ in range(2000):
        counts[sample(logits, [seq_with([1], temperature=1.0)], gen)[0][0]] += 1
    assert torch.allclose(counts / 2000, probs, atol=0.04)


def test_top_k_and_top_p_restrict_the_candidates():
    logits = logits_for([4.0, 3.0, 2.9, 2.8, 2.7])
    top_k = {draw(logits, [seq_with([1], top_k=2)], s)[0] for s in range(200)}
    assert top_k == {0, 1}
    # softmax of [4, 3, 2.9, ...]: token 0 alone holds < 50%, tokens 0 and 1 more than 50%
    top_p = {draw(logits, [seq_with([1], top_p=0.5)], s)[0] for s in range(200)}
    assert top_p == {0, 1}


def test_penalties_push_down_seen_tokens():
    logits = logits_for([3.0, 2.5, 2.0])
    greedy = dict(temperature=0)
    assert draw(logits, [seq_with([0], **greedy)]) == [0]
    assert draw(logits, [seq_with([0], repetition_penalty=2.0, **greedy)]) == [1]  # prompt counts
    assert draw(logits, [seq_with([0], presence_penalty=0.6, **greedy)]) == [0]  # only output counts
    assert draw(logits, [seq_with([5], [0], presence_penalty=0.6, **greedy)]) == [1]
    assert draw(logits, [seq_with([5], [0, 0], frequency_penalty=0.3, **greedy)]) == [1]
    assert draw(logits, [seq_with([5], [0], frequency_penalty=0.3, **greedy)]) == [0]


def test_logprobs_are_the_models_own():
    logits = logits_for([3.0, 2.0, 1.0])
    tokens, logprobs = sample(logits, [seq_with([1], temperature=0, logprobs=2)], torch.Generator())
    expected = logits.log_softmax(-1)[0]
    lp = logprobs[0]
    assert lp.token_id == tokens[0] == 0
    assert lp.logprob == pytest.approx(float(expected[0]))
    assert [t for t, _ in lp.top] == [0, 1]
    assert [v for _, v in lp.top] == pytest.approx(expected[:2].tolist())


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from dynamo_pd.model_store import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(None)))


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], str | None]:
    deltas, stop = [], None
    for i, token in enumerate(ids):
        stop = detok.add(token)
        deltas.append(detok.delta(finished=stop is not None or i == len(ids) - 1))
        if stop:
            break
    return deltas, stop


def test_detokenizer_streams_multibyte_text_exactly(tokenizer):
    ids = tokenizer.encode(" Café 🍕 naïve — 東京 done")
    deltas, _ = stream(IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), []), ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert not any("\ufffd" in d for d in deltas)


def test_stop_string_never_leaks_into_the_stream(tokenizer):
    ids = tokenizer.encode(" The answer is 42. END of transmission")
    detok = IncrementalDetokenizer(tokenizer, [], ["END", "zzz"])
    deltas, stop = stream(detok, ids)
    assert stop == "END"
    assert "".join(deltas) == " The answer is 42. "
    assert all("E" not in d for d in deltas)


@pytest.fixture(scope="module")
def llm():
    from dynamo_pd.llm import LLM

    return LLM(num_kv_blocks=64)


@pytest.mark.slow
def test_sampling_options_end_to_end(llm, prompt_ids):
    prompts = prompt_ids[:3]
    stop = StopConditions(max_tokens=16, ignore_eos=True)
    greedy = llm.generate(prompts, SamplingParams(temperature=0), stop)
    assert [r.token_ids for r in llm.generate(prompts, SamplingParams(temperature=0.8, top_k=1), stop)] == \
        [r.token_ids for r in greedy]

    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    first = llm.generate(prompts[:1], seeded, stop)[0].token_ids
    crowded = llm.generate([prompts[1], prompts[0], prompts[2]], seeded, stop)[1].token_ids
    assert first == crowded, "a seeded request samples the same tokens in any batch"

    text = greedy[1].text
    word = text.split()[len(text.split()) // 2]
    cut = llm.generate(
        prompts[1:2], SamplingParams(temperature=0), StopConditions(max_tokens=16, stop=[word], ignore_eos=True)
    )[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == word
    assert cut.text == text[: text.index(word)]

    token = greedy[2].token_ids[5]
    ended = llm.generate(prompts[2:3], SamplingParams(temperature=0),
                         StopConditions(max_tokens=16, stop_token_ids=[token], ignore_eos=True))[0]
    first_hit = greedy[2].token_ids.index(token)
    assert ended.token_ids == greedy[2].token_ids[: first_hit + 1]
    assert ended.finish_reason == "stop" and ended.stop_reason == token

    logprobs = llm.generate(prompts[:1], SamplingParams(temperature=0, logprobs=3), stop)[0].logprobs
    assert len(logprobs) == 16
    assert all(lp.top[0][0] == lp.token_id and lp.top[0][1] == pytest.approx(lp.logprob) for lp in logprobs)


@pytest.mark.slow
def test_frequency_penalty_reduces_repetition(llm):
    ids = llm.tokenizer.encode("Repeat after me: la la la la la la la la la la la la")
    stop = StopConditions(max_tokens=24, ignore_eos=True)
    plain = llm.generate([ids], SamplingParams(temperature=0), stop)[0].token_ids
    penalised = llm.generate([ids], SamplingParams(temperature=0, frequency_penalty=1.0), stop)[0].token_ids
    assert len(set(penalised)) > len(set(plain))
