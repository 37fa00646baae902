"""n > 1, best_of, logit_bias, echo, prompt_logprobs, chat logprobs and suffix over HTTP on the native engine,
aggregated and 1P1D with pull and push hand-offs side by side (the deployments test_parity shares): each field changes
what a plain request gets, and the disaggregated answers equal the aggregated ones exactly (choices, text,
logprobs, usage; streamed and not), with KV moved and no fallback, so the decode side forked the choices from one
hand-off. suffix is a 400 naming it on every deployment (SmolLM2 has no fill-in-the-middle tokens)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from dynamo_pd.model_store import resolve_model
from tests.e2e.conftest import MODEL, side_by_side
from tests.e2e.test_parity import fallbacks

pytestmark = pytest.mark.slow
PROMPT = "List three colors:"


def answer(client, route: str, stream: bool, **fields) -> dict:
    """What the client gets, per choice index (text, finish, logprobs) and for the request (usage, prompt
    logprobs), joined over chunks when streamed."""
    extra = {"stream_options": {"include_usage": True}} if stream else {}
    if route == "chat":
        made = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                              stream=stream, **extra, **fields)
    else:
        made = client.completions.create(model=MODEL, prompt=PROMPT, stream=stream, **extra, **fields)
    chunks = list(made) if stream else [made]
    choices: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk.choices:
            got = choices.setdefault(c.index, {"text": "", "finish": None, "logprobs": []})
            if route == "chat":
                got["text"] += (c.delta.content if stream else c.message.content) or ""
                got["logprobs"] += [(t.token, t.logprob, [(x.token, x.logprob) for x in t.top_logprobs])
                                    for t in (c.logprobs.content if c.logprobs else [])]
            else:
                got["text"] += c.text
                lp = c.logprobs
                got["logprobs"] += list(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)) if lp else []
            got["finish"] = c.finish_reason or got["finish"]
    usage = chunks[-1].usage
    scores = [getattr(c, "prompt_logprobs", None) for c in chunks[0].choices] if route == "completion" else \
        getattr(chunks[0], "prompt_logprobs", None)
    return {"choices": choices, "usage": (usage.prompt_tokens, usage.completion_tokens), "scores": scores}


def cases(banned: int) -> dict[str, tuple[str, bool, dict]]:
    """name -> (route, stream, fields); `banned`: the token logit_bias bans (the plain answer's first)."""
    seeded = {"max_tokens": 8, "temperature": 0.9, "seed": 7}
    return {
        "plain": ("completion", False, {"max_tokens": 8, "temperature": 0}),
        "n": ("completion", False, {**seeded, "n": 3, "logprobs": 1}),
        "n_streamed": ("completion", True, {**seeded, "n": 3, "logprobs": 1}),
        "chat_n": ("chat", False, {**seeded, "n": 2}),
        "chat_n_streamed": ("chat", True, {**seeded, "n": 2}),
        "chat_logprobs": ("chat", False, {"max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2}),
        "chat_logprobs_streamed": ("chat", True, {"max_tokens": 6, "temperature": 0, "logprobs": True,
                                                  "top_logprobs": 2}),
        "best_of": ("completion", False, {**seeded, "n": 2, "best_of": 3}),
        "echo": ("completion", False, {"max_tokens": 8, "temperature": 0, "echo": True, "logprobs": 1}),
        "echo_streamed": ("completion", True, {"max_tokens": 8, "temperature": 0, "echo": True, "logprobs": 1}),
        "prompt_logprobs": ("completion", False, {"max_tokens": 4, "temperature": 0,
                                                  "extra_body": {"prompt_logprobs": 2}}),
        "logit_bias": ("completion", False, {"max_tokens": 8, "temperature": 0, "logit_bias": {str(banned): -100}}),
    }


@pytest.mark.timeout(600)
def test_every_field_is_honoured_and_1p1d_answers_what_aggregated_does(native, openai_client_factory):
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
    plain = answer(openai_client_factory(native["aggregated"]), "completion", False, max_tokens=8, temperature=0)
    banned = tokenizer(plain["choices"][0]["text"], add_special_tokens=False).input_ids[0]
    run = cases(banned)
    got = side_by_side(native, lambda _, d: {name: answer(openai_client_factory(d), route, stream, **fields)
                                             for name, (route, stream, fields) in run.items()})
    agg = got["aggregated"]
    assert agg["plain"] == plain
    biased = tokenizer(agg["logit_bias"]["choices"][0]["text"], add_special_tokens=False).input_ids
    assert biased[0] != banned and banned not in biased
    for name, n in (("n", 3), ("n_streamed", 3), ("chat_n", 2), ("chat_n_streamed", 2), ("best_of", 2)):
        choices = agg[name]["choices"]
        assert sorted(choices) == list(range(n)) and len({c["text"] for c in choices.values()}) > 1, name
    assert agg["n"]["choices"] == agg["n_streamed"]["choices"] and agg["chat_n"] == agg["chat_n_streamed"]
    assert agg["n"]["usage"][1] == sum(len(c["logprobs"]) for c in agg["n"]["choices"].values())
    # best_of 3 draws n's three choices (seeds 7, 8, 9), answers two of them and counts all three
    assert agg["best_of"]["usage"] == agg["n"]["usage"]
    assert {c["text"] for c in agg["best_of"]["choices"].values()} < {c["text"] for c in agg["n"]["choices"].values()}
    prompt_tokens = agg["echo"]["usage"][0]
    echo = agg["echo"]["choices"][0]
    assert echo["text"] == PROMPT + plain["choices"][0]["text"] and echo["logprobs"][0][1] is None
    assert agg["echo_streamed"]["choices"] == agg["echo"]["choices"]
    (scores,) = agg["prompt_logprobs"]["scores"]
    assert len(scores) == prompt_tokens and scores[0] is None
    # each entry's first key is the prompt's own token; its logprob is the one echo gives that token
    assert [next(iter(s.values()))["logprob"] for s in scores[1:]] == [lp for _, lp, _ in
                                                                        echo["logprobs"][1:prompt_tokens]]
    chat = agg["chat_logprobs"]["choices"][0]
    assert len(chat["logprobs"]) == 6 and all(len(top) == 2 for *_, top in chat["logprobs"])
    assert agg["chat_logprobs_streamed"]["choices"] == agg["chat_logprobs"]["choices"]
    for mode in ("pull", "push"):
        differ = {name: (agg[name], got[mode][name]) for name in run if got[mode][name] != agg[name]}
        assert not differ, (mode, json.dumps(differ, default=str)[:2000])
        assert native[mode].metric("dynamo_pd_kv_transfer_bytes_total") > 0
        assert not any(fallbacks(native[mode]).values()), fallbacks(native[mode])


def test_suffix_is_a_400_naming_it_on_every_deployment(native):
    for mode, deployment in native.items():
        status, body = deployment.post("/v1/completions", {"model": MODEL, "prompt": "def f(", "suffix": "  return 1"})
        assert status == 400 and body["error"]["param"] == "suffix" and "FIM" in body["error"]["message"], (mode, body)
