"""Prefill -> decode continuation inside the native engine: the first output of a PREFILL engine plus
the decode engine's continuation (its echo of the first token dropped) is exactly what an AGGREGATED
engine streams: text under stop strings (holdback), tokens, logprobs, usage, and seeded samples.
Engine cores are driven step by step in this process; KV blocks are copied tensor to tensor."""

from __future__ import annotations

import msgspec
import pytest
import torch

from dynamo_pd.engines.base import EngineConfig, EngineRole
from dynamo_pd.engines.native.core import EngineCore
from dynamo_pd.engines.native.detokenizer import IncrementalDetokenizer
from dynamo_pd.engines.native.sampler import sample, skip_draw
from dynamo_pd.engines.native.sequence import Sequence
from dynamo_pd.handoff_kinds import PushHandoff
from dynamo_pd.protocol import EngineOutput, EngineRequest, SamplingParams, StopConditions

PROMPTS = ["List three colors:", "Le café et la crème brûlée, en français:", "東京は", "Emoji story: 🍕🍕"]
MAX_STEPS = 200


def test_a_skipped_draw_leaves_the_seeded_generator_where_sampling_the_first_token_would():
    logits = torch.randn(1, 32, generator=torch.Generator().manual_seed(3))

    def seq(seed: int) -> Sequence:
        return Sequence(request=EngineRequest(request_id="r", prompt_token_ids=[1], sampling=SamplingParams(
            temperature=0.9, seed=seed)), block_size=16, detokenizer=IncrementalDetokenizer(None, [1], []),
            generator=torch.Generator().manual_seed(seed))

    engine_generator = torch.Generator()
    for seed in range(20):
        sampled, skipped = seq(seed), seq(seed)
        sample(logits, [sampled], engine_generator)  # the prefill side's first draw, made here
        skip_draw(skipped)  # the decode side's stand-in for it
        second = [sample(logits, [s], engine_generator)[0] for s in (sampled, skipped) for _ in range(5)]
        assert second[:5] == second[5:]


@pytest.fixture(scope="module")
def cores():
    return {role: EngineCore(EngineConfig(role=role, num_kv_blocks=96)) for role in EngineRole}


def run(core: EngineCore, request: EngineRequest) -> list[EngineOutput]:
    core.add_request(request)
    return finish(core, request.request_id, [])


def finish(core: EngineCore, rid: str, outs: list[EngineOutput]) -> list[EngineOutput]:
    for _ in range(MAX_STEPS):
        if outs and outs[-1].finish_reason is not None:
            return outs
        outs += [o for o in core.step() if o.request_id == rid]
    raise AssertionError(f"{rid} did not finish in {MAX_STEPS} steps")


def disaggregated(cores, request: EngineRequest, how: str) -> list[EngineOutput]:
    """What the frontend streams: the prefill's first output, then the decode side's outputs minus the
    echoed first token id. how: "pull" / "push" (KV copied into the decode's blocks) or "fallback"
    (the decode engine prefills the prompt itself and continues from the given first token)."""
    prefill, decode = cores[EngineRole.PREFILL], cores[EngineRole.DECODE]
    (first,) = run(prefill, request)
    if first.handoff is None:
        assert first.finish_reason in ("stop", "length") and not prefill.held
        return [first]
    assert first.finish_reason == "prefill_done"
    token = first.token_ids[0]
    rid = request.request_id
    if how == "fallback":
        prefill.release_handoff(rid)
        rest = run(decode, msgspec.structs.replace(request, first_token_id=token))
    else:
        held = first.handoff
        handoff = held if how == "pull" else PushHandoff(worker_id="p", peer_endpoint="", request_id=rid,
                                                         num_tokens=held.num_tokens)
        decode.add_request(msgspec.structs.replace(request, handoff=handoff,
                                                   first_token_id=token if how == "pull" else None))
        assert decode.step() == []  # admitted for loading
        (seq,) = decode.take_new_loads()
        cached = (seq.num_cached_tokens or 0) // seq.block_size
        src, dst = torch.tensor(held.block_ids[cached:]), torch.tensor(seq.block_table[cached:])
        decode.kv_cache[:, :, dst] = prefill.kv_cache[:, :, src]
        prefill.release_handoff(rid)
        rest = finish(decode, rid, decode.finish_load(rid, None if how == "pull" else [token]))
    echo = rest[0]
    assert echo.token_ids[:1] == [token] and echo.logprobs is None
    rest[0] = msgspec.structs.replace(echo, token_ids=echo.token_ids[1:])
    return [msgspec.structs.replace(first, finish_reason=None, usage=None, handoff=None), *rest]


def summary(outs: list[EngineOutput]) -> dict:
    last = outs[-1]
    return {"text": "".join(o.text for o in outs), "tokens": [t for o in outs for t in o.token_ids],
            "logprobs": [(lp.token_id, lp.logprob, lp.top) for o in outs for lp in (o.logprobs or [])],
            "finish": (last.finish_reason, last.stop_reason),
            "usage": (last.usage.prompt_tokens, last.usage.completion_tokens)}


def stop_cases(cores, tokenizer) -> list[tuple[str, StopConditions]]:
    """Stop strings cut from each prompt's own greedy output: hit by the first token, straddling the
    first two tokens, later, never (with a long holdback), multi-byte; plus a stop token and max_tokens 1."""
    cases = []
    for p, prompt in enumerate(PROMPTS):
        ids = tokenizer.encode(prompt)
        outs = run(cores[EngineRole.AGGREGATED], EngineRequest(
            request_id=f"probe{p}", prompt_token_ids=ids, sampling=SamplingParams(temperature=0),
            stop=StopConditions(max_tokens=12, ignore_eos=True)))
        text = "".join(o.text for o in outs)
        one = outs[0].text or outs[1].text  # the first printable token's text
        n = len(one)
        stops = [[one[-1:]], [one[-1:] + text[n:n + 2]], [text[n + 3:n + 6], "#" * 12], [text[4:8] + "\x07"]]
        cases += [(prompt, StopConditions(max_tokens=12, stop=[s for s in stop if s] or ["zz"]))
                  for stop in stops]
        cases += [(prompt, StopConditions(max_tokens=12, stop_token_ids=outs[0].token_ids)),
                  (prompt, StopConditions(max_tokens=1))]
    return cases


HOW = ("pull", "push", "fallback")


@pytest.mark.slow
def test_prefill_plus_decode_streams_exactly_what_aggregated_does(cores):
    tokenizer = cores[EngineRole.AGGREGATED].tokenizer
    results = []
    for i, (prompt, stop) in enumerate(stop_cases(cores, tokenizer)):
        request = EngineRequest(request_id=f"case{i}", prompt_token_ids=tokenizer.encode(prompt),
                                sampling=SamplingParams(temperature=0, logprobs=2 if i % 2 else None), stop=stop)
        expected = summary(run(cores[EngineRole.AGGREGATED], msgspec.structs.replace(request, request_id=f"agg{i}")))
        how = HOW[i % len(HOW)]
        results.append((prompt, stop.stop, how, expected, summary(disaggregated(cores, request, how))))
    differ = [r for r in results if r[3] != r[4]]
    assert not differ, differ[:3]
    assert any(r[3]["finish"][0] == "stop" and len(r[3]["tokens"]) == 1 for r in results), "a first-token stop"
    for role in EngineRole:
        core = cores[role]
        assert not core.seqs and not core.held and core.block_manager.num_free_blocks == core.block_manager.num_blocks


@pytest.mark.slow
def test_seeded_sampling_continues_on_the_decode_side_as_aggregated(cores):
    tokenizer = cores[EngineRole.AGGREGATED].tokenizer
    for i, (seed, prompt) in enumerate((seed, prompt) for seed in (1, 42) for prompt in PROMPTS[:3]):
        request = EngineRequest(request_id=f"seeded{i}", prompt_token_ids=tokenizer.encode(prompt),
                                sampling=SamplingParams(temperature=0.9, seed=seed, logprobs=1),
                                stop=StopConditions(max_tokens=10, ignore_eos=True))
        expected = summary(run(cores[EngineRole.AGGREGATED], msgspec.structs.replace(request, request_id=f"agg{i}")))
        for how in HOW:
            request = msgspec.structs.replace(request, request_id=f"seeded{i}-{how}")
            assert summary(disaggregated(cores, request, how)) == expected, (seed, prompt, how)
