"""Structured output in the native sampler: one step's bitmask masks the rows with a grammar and leaves the
others as they were; a sequence stops where its grammar ends (EOS allowed only then); a token its grammar
refuses ends it in error. Then whole engines: the native engine's JSON under a grammar is the same text
aggregated, across a prefill -> decode hand-off (pull, push, local fallback) and resumed after a migration
(cut early, midway and late), greedy and seeded, and schema-valid; the mocker's too."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from dynamo_pd.engines.base import EngineConfig, EngineRole
from dynamo_pd.engines.native.config import ModelConfig
from dynamo_pd.engines.native.core import EngineCore
from dynamo_pd.engines.native.detokenizer import IncrementalDetokenizer
from dynamo_pd.engines.native.grammar import allowed_tokens, huggingface_grammars
from dynamo_pd.engines.native.sampler import sample
from dynamo_pd.engines.native.sequence import Sequence
from dynamo_pd.protocol import EngineRequest, Guided, InvalidRequestError, SamplingParams, StopConditions
from tests.engines.test_native_continuation import disaggregated, run, summary
from tests.engines.test_native_resume import resumed

CHOICE = Guided(kind="choice", spec='["yes", "no"]', param="guided_choice")
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["name", "age"]},
    {"type": "object", "required": ["colour", "ok"],
     "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}}},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 2, "maxItems": 3},
]
PROMPTS = ["A person, as JSON:", "Pick a colour. Answer in JSON:", "Three small numbers:"]


@pytest.fixture(scope="module")
def vocab(model_dir) -> ModelConfig:
    return ModelConfig.from_dir(model_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def grammars(model_dir, vocab):
    return huggingface_grammars(model_dir, vocab.vocab_size, frozenset(vocab.eos_token_ids))


def seq_under(tokenizer, grammars, guided: Guided | None, ignore_eos: bool = False, **sampling) -> Sequence:
    params = SamplingParams(guided=guided, **sampling)
    prompt = tokenizer.encode("Answer:")
    seq = Sequence(request=EngineRequest(request_id="r", prompt_token_ids=prompt, sampling=params,
                                         stop=StopConditions(max_tokens=8, ignore_eos=ignore_eos)),
                   block_size=16, detokenizer=IncrementalDetokenizer(tokenizer, prompt, []),
                   generator=None if params.seed is None else torch.Generator().manual_seed(params.seed))
    if guided is not None:
        seq.grammar = grammars.matcher(guided)
    return seq


def choice_starts(tokenizer, vocab) -> set[int]:
    """Read from the tokenizer alone: the tokens that can start "yes" or "no"."""
    texts = tokenizer.batch_decode([[t] for t in range(vocab.vocab_size)])
    return {t for t, text in enumerate(texts) if text and ("yes".startswith(text) or "no".startswith(text))}


def test_one_step_masks_the_rows_under_a_grammar_and_leaves_the_others(tokenizer, grammars, vocab):
    allowed = choice_starts(tokenizer, vocab)
    outside = tokenizer.encode(" hello")[0]
    logits = torch.randn(4, vocab.vocab_size, generator=torch.Generator().manual_seed(0))
    logits[:, outside] = 50.0  # what every row picks without a mask
    given = logits.clone()
    seqs = [seq_under(tokenizer, grammars, None, temperature=0),
            seq_under(tokenizer, grammars, CHOICE, temperature=0),
            seq_under(tokenizer, grammars, CHOICE, temperature=1.0, seed=3),
            seq_under(tokenizer, grammars, None, temperature=1.0, seed=4)]
    tokens, _ = sample(logits, seqs, torch.Generator().manual_seed(1))

    assert tokens[0] == outside
    assert tokens[1] == max(allowed, key=lambda t: given[1, t])
    assert tokens[2] in allowed
    alone = sample(given[3:].clone(), [seq_under(tokenizer, grammars, None, temperature=1.0, seed=4)],
                   torch.Generator().manual_seed(1))[0]
    assert tokens[3] == alone[0]  # the free seeded row draws as it would in a batch of its own
    for row in (0, 3):
        assert torch.equal(logits[row], given[row])
    for row in (1, 2):
        kept = torch.isfinite(logits[row]).nonzero().flatten().tolist()
        assert set(kept) == allowed and torch.equal(logits[row, kept], given[row, kept])


def test_a_greedy_row_whose_best_token_its_grammar_allows_needs_no_mask_and_its_matcher_stays(tokenizer, grammars,
                                                                                              vocab):
    allowed = choice_starts(tokenizer, vocab)
    inside, outside = tokenizer.encode("yes")[0], tokenizer.encode(" hello")[0]
    assert inside in allowed
    logits = torch.randn(2, vocab.vocab_size, generator=torch.Generator().manual_seed(0))
    logits[0, inside] = 50.0  # row 0's best token is one its grammar allows; row 1's is not
    logits[1, outside] = 50.0
    given = logits.clone()
    seqs = [seq_under(tokenizer, grammars, CHOICE, temperature=0) for _ in range(2)]
    before = allowed_tokens(seqs[0].grammar, vocab.vocab_size)
    tokens, _ = sample(logits, seqs, torch.Generator().manual_seed(1))

    assert tokens == [inside, max(allowed, key=lambda t: given[1, t])]
    assert torch.equal(logits[0], given[0])  # not masked
    assert not torch.isfinite(logits[1]).all()
    assert torch.equal(allowed_tokens(seqs[0].grammar, vocab.vocab_size), before)  # the check moved nothing


def test_a_row_sampled_under_a_grammar_draws_from_the_masked_distribution(tokenizer, grammars, vocab):
    """Half the mass outside the grammar: about half the draws are kept as they came, the rest are made again
    from the masked row, and together they follow the masked distribution."""
    allowed = sorted(choice_starts(tokenizer, vocab))
    outside = tokenizer.encode(" hello")[0]
    logits = torch.full((1, vocab.vocab_size), -1e4)
    logits[0, allowed] = torch.linspace(0.0, 2.0, len(allowed))
    logits[0, outside] = torch.logsumexp(logits[0, allowed], dim=0)
    expected = logits[0, allowed].softmax(dim=0)
    draws, counts, masked = 2000, torch.zeros(len(allowed)), 0
    for seed in range(draws):
        given = logits.clone()
        token = sample(given, [seq_under(tokenizer, grammars, CHOICE, temperature=1.0, seed=seed)],
                       torch.Generator())[0][0]
        counts[allowed.index(token)] += 1
        masked += bool(torch.isinf(given).any())
    assert abs(masked / draws - 0.5) < 4 * (0.25 / draws) ** 0.5
    assert ((counts / draws - expected).abs() < 4 * (expected * (1 - expected) / draws).sqrt()).all(), counts


def test_a_sequence_stops_where_its_grammar_ends_and_eos_is_allowed_only_there(tokenizer, grammars, vocab):
    eos = vocab.eos_token_ids[0]
    for ignore_eos in (False, True):
        seq = seq_under(tokenizer, grammars, CHOICE, ignore_eos, temperature=0)
        append = dict(eos_token_ids=frozenset(vocab.eos_token_ids), max_model_len=2048, prefill=False)
        text = ""
        for token in tokenizer.encode("yes"):
            assert not allowed_tokens(seq.grammar, vocab.vocab_size)[eos]
            out = seq.append(token, None, **append)
            assert out.finish_reason is None
            text += out.text
        assert allowed_tokens(seq.grammar, vocab.vocab_size).nonzero().flatten().tolist() == [eos]
        out = seq.append(eos, None, **append)
        assert out.finish_reason == "stop" and text + out.text == "yes"


def test_a_token_the_grammar_refuses_ends_the_request_in_error(tokenizer, grammars, vocab):
    seq = seq_under(tokenizer, grammars, CHOICE, temperature=0)
    out = seq.append(tokenizer.encode(" hello")[0], None, eos_token_ids=frozenset(vocab.eos_token_ids),
                     max_model_len=2048, prefill=False)
    assert out.finish_reason == "error" and "grammar" in out.error


def test_a_spec_that_does_not_compile_is_the_clients_error_and_a_good_one_compiles_once(grammars):
    with pytest.raises(InvalidRequestError, match="guided_regex") as err:
        grammars.compile(Guided(kind="regex", spec="a(b", param="guided_regex"))
    assert err.value.param == "guided_regex"
    assert grammars.compile(CHOICE) is grammars.compile(Guided(kind="choice", spec='["yes", "no"]',
                                                               param="guided_choice"))


def texts_of(outs) -> str:
    return "".join(o.text for o in outs)


@pytest.fixture(scope="module")
def cores():
    return {role: EngineCore(EngineConfig(role=role, num_kv_blocks=96)) for role in EngineRole}


@pytest.mark.slow
def test_json_under_a_grammar_is_one_text_aggregated_handed_off_and_resumed(cores):
    agg = cores[EngineRole.AGGREGATED]
    checked = 0
    for i, (schema, prompt) in enumerate(zip(SCHEMAS, PROMPTS)):
        guided = Guided(kind="json_schema", spec=json.dumps(schema))
        for sampling in (SamplingParams(temperature=0, guided=guided),
                         SamplingParams(temperature=0.8, seed=11 + i, guided=guided)):
            request = EngineRequest(request_id=f"case{i}-{sampling.seed}",
                                    prompt_token_ids=agg.tokenizer.encode(prompt), sampling=sampling,
                                    stop=StopConditions(max_tokens=48))
            outs = run(agg, request)
            expected = summary(outs)
            assert expected["finish"] == ("stop", None), expected
            jsonschema.validate(json.loads(expected["text"]), schema)
            for how in ("pull", "push", "fallback"):
                assert summary(disaggregated(cores, request, how)) == expected, (how, schema)
            for k in sorted({1, len(outs) // 2, len(outs) - 1}):  # cut early, midway, late
                assert resumed(agg, request, outs, k) == expected, (k, schema)
                checked += 1
    assert checked >= 2 * 3 * len(SCHEMAS)
    for core in cores.values():
        assert not core.seqs and core.block_manager.num_free_blocks == core.block_manager.num_blocks


@pytest.mark.slow
def test_a_resumed_token_the_grammar_refuses_is_the_clients_error(cores, tokenizer):
    agg = cores[EngineRole.AGGREGATED]
    request = EngineRequest(request_id="bad-resume", prompt_token_ids=tokenizer.encode("Answer:"),
                            sampling=SamplingParams(guided=CHOICE), stop=StopConditions(max_tokens=4),
                            resume_token_ids=tokenizer.encode(" hello"))
    with pytest.raises(InvalidRequestError) as err:
        agg.add_request(request)
    assert err.value.param == "resume_token_ids" and not agg.seqs


@pytest.mark.slow
def test_the_mocker_emits_schema_valid_json_and_hands_it_off_unchanged():
    from dynamo_pd.engines.mocker.core import MockerCore
    from dynamo_pd.engines.mocker.profile import h100_llama8b

    mockers = {role: MockerCore(EngineConfig(role=role, num_kv_blocks=96), h100_llama8b())
               for role in EngineRole}
    agg = mockers[EngineRole.AGGREGATED]
    for i, schema in enumerate(SCHEMAS):
        guided = Guided(kind="json_schema", spec=json.dumps(schema))
        request = EngineRequest(request_id=f"mock{i}", prompt_token_ids=[100 + i] * 20,
                                sampling=SamplingParams(temperature=0.7, seed=i, guided=guided),
                                stop=StopConditions(max_tokens=400))
        expected = summary(run(agg, request))
        assert expected["finish"] == ("stop", None), expected
        jsonschema.validate(json.loads(expected["text"]), schema)
        for how in ("pull", "push"):
            assert summary(disaggregated(mockers, request, how)) == expected, how


def test_an_overflowing_repetition_penalty_still_picks_a_token_the_grammar_allows(tokenizer, grammars, vocab):
    """Every allowed token seen and its logit negative: a huge repetition_penalty sends them to -inf beside the
    masked ones, and an all -inf row picked token 0 (greedy) or garbage (NaN, sampled): schemathesis found it."""
    allowed = sorted(choice_starts(tokenizer, vocab))
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        logits = torch.randn(1, vocab.vocab_size, generator=torch.Generator().manual_seed(0))
        logits[0, allowed] = -1.0
        seq = seq_under(tokenizer, grammars, CHOICE, repetition_penalty=1e300, **sampling)
        seq.token_ids += allowed
        tokens, _ = sample(logits, [seq], torch.Generator().manual_seed(1))
        assert tokens[0] in allowed, sampling


def test_a_process_exiting_while_the_vocabulary_builds_waits_for_the_build(tmp_path):
    """Cut short, xgrammar's threads building a vocabulary's tables abort the process (SIGABRT: a worker
    stopped right after it started): its exit waits for the build instead."""
    built = tmp_path / "built"
    code = f"""
import time
from dynamo_pd.engines.native.grammar import Grammars

def tokenizer_info():
    time.sleep(1.0)  # the main thread has ended meanwhile
    import xgrammar as xgr
    info = xgr.TokenizerInfo(["a", "b", "c"])
    open({str(built)!r}, "w").close()
    return info

Grammars(tokenizer_info)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert built.exists(), "the process exited before the vocabulary was built"
