"""n > 1 choices, logit_bias and prompt logprobs in the native engine core (and the mocker's, which shares its
scheduler, block manager and forking): one prefill whose choices fork at the prompt's end, sharing its full
blocks and copying its partial last one; choice i sampled as a request seeded seed + i; the same choices after a
pull, push or local-fallback hand-off as aggregated; biases applied before sampling; prompt logprobs computed
where the prompt is (never read from the prefix cache) and sent once, with the first output. Cores are driven step
by step in this process; KV blocks are copied tensor to tensor, as test_native_continuation does."""

from __future__ import annotations

import msgspec
import pytest
import torch
from transformers import AutoTokenizer

from dynamo_pd.engines.base import EngineConfig, EngineRole
from dynamo_pd.engines.mocker.core import MockerCore
from dynamo_pd.engines.mocker.profile import h100_llama8b
from dynamo_pd.engines.native.core import EngineCore
from dynamo_pd.engines.native.sequence import SequenceStatus
from dynamo_pd.handoff_kinds import PushHandoff
from dynamo_pd.model_store import resolve_model
from dynamo_pd.protocol import EngineOutput, EngineRequest, InvalidRequestError, SamplingParams, StopConditions

PROMPT = "Here is a list of fruits, one per line, with their colours: apple red,"  # not a whole number of blocks
MAX_STEPS = 300
BLOCKS = 96


def make(kind: str, role: EngineRole, num_kv_blocks: int = BLOCKS) -> EngineCore:
    config = EngineConfig(role=role, num_kv_blocks=num_kv_blocks)
    return EngineCore(config) if kind == "native" else MockerCore(config, h100_llama8b())


@pytest.fixture(scope="module", params=["native", "mocker"])
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def cores(kind):
    return {role: make(kind, role) for role in EngineRole}


@pytest.fixture(scope="module")
def ids() -> list[int]:
    return AutoTokenizer.from_pretrained(resolve_model(None))(PROMPT).input_ids


def request(rid: str, ids: list[int], max_tokens: int = 8, **sampling) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=ids, sampling=SamplingParams(**sampling),
                         stop=StopConditions(max_tokens=max_tokens))


def run(core: EngineCore, req: EngineRequest) -> list[EngineOutput]:
    core.add_request(req)
    return finish(core, req.request_id, [])


def finish(core: EngineCore, rid: str, outs: list[EngineOutput]) -> list[EngineOutput]:
    for _ in range(MAX_STEPS):
        if outs and outs[-1].ends:
            return outs
        outs += [o for o in core.step() if o.request_id == rid]
    raise AssertionError(f"{rid} did not end in {MAX_STEPS} steps")


def choices(outs: list[EngineOutput]) -> dict[int, dict]:
    """Per choice what a client is sent: text, tokens, logprobs, finish."""
    by: dict[int, dict] = {}
    for o in outs:
        c = by.setdefault(o.index, {"text": "", "tokens": [], "logprobs": [], "finish": None})
        c["text"] += o.text
        c["tokens"] += o.token_ids
        c["logprobs"] += [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs or []]
        if o.finish_reason is not None:
            c["finish"] = (o.finish_reason, o.stop_reason)
    return by


def exact(choice: dict) -> dict:
    """A choice less its logprobs' values (the tokens they rank stay)."""
    return {**choice, "logprobs": [(t, [k for k, _ in top]) for t, _, top in choice["logprobs"]]}


def logprob_values(choice: dict) -> list[float]:
    return [x for _, lp, top in choice["logprobs"] for x in (lp, *(v for _, v in top))]


def assert_idle(core: EngineCore) -> None:
    bm = core.block_manager
    assert not core.seqs and not core.held and bm.num_free_blocks == bm.num_blocks, (core.seqs, bm.num_free_blocks)
    assert all(count == 0 for count in bm.ref_counts)


def test_choice_i_samples_as_a_request_seeded_seed_plus_i_and_usage_counts_the_prompt_once(cores, ids):
    core = cores[EngineRole.AGGREGATED]
    many = run(core, request("many", ids, temperature=0.9, seed=40, n=4, logprobs=1))
    alone = {i: choices(run(core, request(f"alone{i}", ids, temperature=0.9, seed=40 + i, logprobs=1)))[0]
             for i in range(4)}
    got = choices(many)
    assert sorted(got) == [0, 1, 2, 3]
    # four rows against one: the batch's matrix products may sum in another order (AVX-512 hosts do), so the
    # logprobs agree to float rounding; everything else exactly
    assert {i: exact(c) for i, c in got.items()} == {i: exact(c) for i, c in alone.items()}
    for i in got:
        assert logprob_values(got[i]) == pytest.approx(logprob_values(alone[i]), abs=1e-4)
    assert len({c["text"] for c in got.values()}) > 1, "the seeds give different choices"
    last = many[-1]
    assert last.ends and last.usage.prompt_tokens == len(ids)
    assert last.usage.completion_tokens == sum(len(c["tokens"]) for c in got.values())
    assert [o for o in many if o.usage is not None] == [last]  # one usage, with the request's last output
    assert sorted(o.choices_left for o in many if o.finish_reason) == [0, 1, 2, 3]
    assert_idle(core)


def test_one_prefill_the_forks_share_its_full_blocks_and_copy_its_partial_last_one(cores, ids):
    core, bs = cores[EngineRole.AGGREGATED], cores[EngineRole.AGGREGATED].block_manager.block_size
    assert len(ids) % bs, "a prompt ending inside a block: its last block is copied"
    core.add_request(request("fork", ids, temperature=0.9, seed=3, n=3, max_tokens=4))
    first = core.seqs["fork"]
    while first.forks[0].status is SequenceStatus.FORK:
        assert all(fork not in core.scheduler.waiting for fork in first.forks)  # nothing of theirs computed
        core.step()
    full = len(ids) // bs
    for fork in first.forks:
        assert fork.block_table[:full] == first.block_table[:full]  # shared ...
        assert fork.block_table[full] != first.block_table[full]  # ... but the partial one, copied on write
        assert fork.num_computed_tokens == len(ids)
    bm = core.block_manager
    assert all(bm.ref_counts[b] == 3 for b in first.block_table[:full])
    assert len({f.block_table[full] for f in [first, *first.forks]}) == 3
    finish(core, "fork", [])
    assert_idle(core)


def test_a_block_aligned_prompt_forks_without_a_copy(cores, ids):
    core, bs = cores[EngineRole.AGGREGATED], cores[EngineRole.AGGREGATED].block_manager.block_size
    aligned = (ids * 3)[:2 * bs]
    got = choices(run(core, request("aligned", aligned, temperature=0.9, seed=9, n=2)))
    alone = {i: choices(run(core, request(f"aligned{i}", aligned, temperature=0.9, seed=9 + i)))[0] for i in (0, 1)}
    assert got == alone
    assert_idle(core)


def test_forks_that_find_no_free_block_compute_the_prompts_end_themselves(kind, cores, ids):
    bs = cores[EngineRole.AGGREGATED].block_manager.block_size
    needed = -(-(len(ids) + 4) // bs)
    tight = make(kind, EngineRole.AGGREGATED, num_kv_blocks=needed + 1)  # one spare: one fork copies, two wait
    outs = run(tight, request("tight", ids, temperature=0, n=4, max_tokens=4))
    greedy = choices(run(cores[EngineRole.AGGREGATED], request("greedy", ids, temperature=0, max_tokens=4)))[0]
    got = choices(outs)
    assert sorted(got) == [0, 1, 2, 3] and all(c["tokens"] == greedy["tokens"] for c in got.values())
    assert outs[-1].usage.completion_tokens == 16
    assert_idle(tight)


def disaggregated(cores, req: EngineRequest, how: str) -> list[EngineOutput]:
    """What the frontend streams: the prefill's outputs (one per choice, the hand-off with the last), then the
    decode side's, each choice's echo of its first token dropped and nothing of a choice its first token
    ended. how: "pull", "push" (KV copied into the decode's blocks) or "fallback" (prefilled there)."""
    prefill, decode = cores[EngineRole.PREFILL], cores[EngineRole.DECODE]
    firsts = run(prefill, req)
    assert len(firsts) == req.sampling.n and all(len(o.token_ids) == 1 for o in firsts)
    assert [o.index for o in firsts] == list(range(req.sampling.n))
    last = firsts[-1]
    if last.handoff is None:
        assert all(o.finish_reason in ("stop", "length") for o in firsts) and not prefill.held
        return firsts
    tokens = [o.token_ids[0] for o in firsts]
    ended = {o.index for o in firsts if o.finish_reason != "prefill_done"}
    rid = req.request_id
    continued = msgspec.structs.replace(req, first_token_id=tokens[0], fork_token_ids=tokens[1:])
    if how == "fallback":
        prefill.release_handoff(rid)
        rest = run(decode, continued)
    else:
        held = last.handoff
        handoff = held if how == "pull" else PushHandoff(worker_id="p", peer_endpoint="", request_id=rid,
                                                         num_tokens=held.num_tokens)
        decode.add_request(msgspec.structs.replace(continued, handoff=handoff) if how == "pull" else
                           msgspec.structs.replace(req, handoff=handoff))
        assert decode.step() == []  # admitted for loading
        (seq,) = decode.take_new_loads()
        cached = (seq.num_cached_tokens or 0) // seq.block_size
        src, dst = torch.tensor(held.block_ids[cached:]), torch.tensor(seq.block_table[cached:])
        decode.kv_cache[:, :, dst] = prefill.kv_cache[:, :, src]
        prefill.release_handoff(rid)
        rest = finish(decode, rid, decode.finish_load(rid, None if how == "pull" else tokens))
    sent = [msgspec.structs.replace(o, usage=None, handoff=None,
                                    finish_reason=None if o.index not in ended else o.finish_reason) for o in firsts]
    echoed: set[int] = set()
    for o in rest:
        if o.index in ended:
            assert not o.ends, "a choice ended at its first token is never the request's last"
            continue
        if o.index not in echoed and o.token_ids:
            assert o.token_ids[0] == tokens[o.index] and o.logprobs is None
            echoed.add(o.index)
            o = msgspec.structs.replace(o, token_ids=o.token_ids[1:])
        sent.append(o)
    assert not prefill.held and not decode.seqs
    return sent


def summary(outs: list[EngineOutput]) -> dict:
    last = outs[-1]
    return {"choices": choices(outs), "usage": (last.usage.prompt_tokens, last.usage.completion_tokens)}


@pytest.mark.parametrize("how", ["pull", "push", "fallback"])
def test_the_choices_after_a_hand_off_are_the_aggregated_ones(cores, ids, how):
    aggregated = cores[EngineRole.AGGREGATED]
    cases = [request(f"{how}-seeded", ids, temperature=0.9, seed=11, n=3, logprobs=2),
             request(f"{how}-greedy", ids, temperature=0, n=2, max_tokens=6)]
    for req in cases:
        want = summary(run(aggregated, msgspec.structs.replace(req, request_id=req.request_id + "-agg")))
        assert summary(disaggregated(cores, req, how)) == want, req.request_id
    for core in cores.values():
        assert_idle(core)


def test_a_choice_its_first_token_ends_ends_on_the_prefill_and_the_others_go_on(cores, ids):
    aggregated = cores[EngineRole.AGGREGATED]
    for seed in range(20, 40):  # seeds whose choice 1 starts with a token the others never sample
        probe = choices(run(aggregated, request(f"probe{seed}", ids, temperature=1.0, seed=seed, n=3, max_tokens=4)))
        stopper = probe[1]["tokens"][0]
        if all(stopper not in probe[i]["tokens"] for i in (0, 2)):
            break
    else:
        raise AssertionError("no seed in [20, 40) has choice 1 start with a token of its own")
    req = msgspec.structs.replace(request("ends", ids, temperature=1.0, seed=seed, n=3, max_tokens=4),
                                  stop=StopConditions(max_tokens=4, stop_token_ids=[stopper]))
    want = summary(run(aggregated, msgspec.structs.replace(req, request_id="ends-agg")))
    assert want["choices"][1]["tokens"] == [stopper] and want["choices"][1]["finish"] == ("stop", stopper)
    for how in ("pull", "push"):
        assert summary(disaggregated(cores, msgspec.structs.replace(req, request_id=f"ends-{how}"), how)) == want
    for core in cores.values():
        assert_idle(core)


def test_logit_bias_is_applied_before_sampling_row_by_row(cores, ids):
    core = cores[EngineRole.AGGREGATED]
    plain = choices(run(core, request("plain", ids, temperature=0)))[0]["tokens"]
    banned = choices(run(core, request("banned", ids, temperature=0, logit_bias={plain[0]: -100.0})))[0]["tokens"]
    assert banned[0] != plain[0]
    forced_token = plain[2]
    together = run_together(core, [request("forced", ids, temperature=0, logit_bias={forced_token: 100.0}),
                                   request("beside", ids, temperature=0)])
    assert choices(together["beside"])[0]["tokens"] == plain  # an unbiased request in the same batch: untouched
    assert set(choices(together["forced"])[0]["tokens"]) == {forced_token}
    assert_idle(core)


def run_together(core: EngineCore, reqs: list[EngineRequest]) -> dict[str, list[EngineOutput]]:
    """The requests in the same batches, to their ends."""
    outs: dict[str, list[EngineOutput]] = {req.request_id: [] for req in reqs}
    for req in reqs:
        core.add_request(req)
    for _ in range(MAX_STEPS):
        if all(o and o[-1].ends for o in outs.values()):
            return outs
        for out in core.step():
            outs[out.request_id].append(out)
    raise AssertionError(f"not ended in {MAX_STEPS} steps")


def test_prompt_logprobs_are_the_models_and_come_once_with_the_first_output(cores, ids):
    core = cores[EngineRole.AGGREGATED]
    run(core, request("warm", ids, temperature=0))  # the prompt is now in the prefix cache
    outs = run(core, request("scored", ids, temperature=0, prompt_logprobs=2, n=2))
    scored = [o for o in outs if o.prompt_logprobs is not None]
    assert len(scored) == 1 and scored[0] is outs[0] and scored[0].index == 0
    scores = scored[0].prompt_logprobs
    assert len(scores) == len(ids) and scores[0] is None
    assert [s.token_id for s in scores[1:]] == ids[1:] and all(len(s.top) == 2 for s in scores[1:])
    assert outs[-1].usage.cached_tokens == 0, "a scored prompt is computed, not read from the cache"
    if isinstance(core, MockerCore):
        return  # the mocker's logprobs are hashes: no model to agree with
    for p in (3, len(ids) - 1):  # the logprobs the engine gives the token that follows prompt[:p]
        (first,) = [o for o in run(core, request(f"at{p}", ids[:p], temperature=0, logprobs=20, max_tokens=1))]
        alternatives = dict(first.logprobs[0].top)
        assert scores[p].token_id in alternatives, "the prompt's token is among the 20 likeliest"
        assert scores[p].logprob == pytest.approx(alternatives[scores[p].token_id], abs=1e-4)
        assert dict(scores[p].top) == pytest.approx(dict(first.logprobs[0].top[:2]), abs=1e-4)


def test_prompt_logprobs_cross_a_hand_off_with_the_prefills_first_output(cores, ids):
    req = request("scored-pd", ids, temperature=0, prompt_logprobs=1)
    want = run(cores[EngineRole.AGGREGATED], msgspec.structs.replace(req, request_id="scored-agg"))[0]
    sent = disaggregated(cores, req, "pull")
    assert sent[0].prompt_logprobs == want.prompt_logprobs
    assert all(o.prompt_logprobs is None for o in sent[1:])


def test_n_above_one_does_not_resume(cores, ids):
    req = msgspec.structs.replace(request("resumed", ids, n=2), resume_token_ids=[ids[0]])
    with pytest.raises(InvalidRequestError) as err:
        cores[EngineRole.AGGREGATED].add_request(req)
    assert err.value.param == "n"
