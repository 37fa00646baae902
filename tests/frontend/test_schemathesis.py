"""A real 1 prefill + 1 decode deployment, driven by requests generated from its own /openapi.json: every
schema-valid request (its model-dependent values bounded: the served model's name, token ids inside the
vocabulary, short texts) is answered 2xx, or 400 context_length_exceeded when its rendered prompt still outgrows
the small KV cache, and no request, valid or not, gets a 5xx.
Examples differ from run to run (the seed is printed). The client errors only a worker can find (its vocabulary,
its KV cache) come back as 400s, never retried on another worker and never counted as prefill fallbacks."""

from __future__ import annotations

import json
import random

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from schemathesis import GenerationMode

from tests.e2e.conftest import MODEL, Deployment

pytestmark = pytest.mark.slow
EXAMPLES = 30  # per operation and mode: bounds the run (each valid completion runs the engine)
VOCAB = 49152  # SmolLM2's
TEXT_CHARS = 48  # a character can take 4 byte tokens: 4 messages of 48 stay far inside the ~1100-token cache


def _bounded(body: dict) -> None:
    """What the schema cannot know, set so a valid case reaches the engine and fits: the served model, a short
    output, token ids inside the vocabulary, short texts."""
    body["model"] = MODEL
    # JSON Schema's integer takes 5329.0 as well: floats are bounded too (seed 1930551246 sent one)
    number = lambda key: isinstance(body.get(key), (int, float)) and not isinstance(body[key], bool)  # noqa: E731
    for key in ("max_tokens", "max_completion_tokens"):
        if number(key):
            body[key] = min(int(body[key]), 2)
    # the generator compares int64's bounds as floats: 2**63 + 191 passed as below 2**63 (seed 188033766)
    if number("seed"):
        body["seed"] = max(-(1 << 63), min(int(body["seed"]), (1 << 63) - 1))
    # what depends on the model or on other fields: its FIM tokens (suffix), its vocabulary (logit_bias), specs
    # that must compile (structured output, a forced tool call), best_of >= n, nothing scored while streaming
    for key in ("suffix", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structural_tag",
                "structured_outputs", "guided_decoding_backend"):
        body.pop(key, None)
    if isinstance(body.get("response_format"), dict) and body["response_format"].get("type") != "json_object":
        body.pop("response_format")
    if body.get("tool_choice") not in (None, "none", "auto"):
        body.pop("tool_choice")
    if isinstance(body.get("logit_bias"), dict):
        body["logit_bias"] = {str(int(k) % VOCAB): v for k, v in body["logit_bias"].items()}
    if number("n"):
        body["n"] = min(int(body["n"]), 4)
    if number("best_of"):
        body["best_of"] = max(min(int(body["best_of"]), 4), body.get("n") or 1)
    if body.get("best_of") or body.get("prompt_logprobs") is not None:
        body["stream"] = False
    if "max_completion_tokens" not in body:
        body["max_tokens"] = min(body.get("max_tokens") or 2, 2)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        body["prompt"] = [t % VOCAB for t in prompt[:64]]
    elif isinstance(prompt, str):
        body["prompt"] = prompt[:TEXT_CHARS]
    if isinstance(body.get("messages"), list):
        body["messages"] = body["messages"][:4]
        for message in body["messages"]:
            if isinstance(message.get("content"), str):
                message["content"] = message["content"][:TEXT_CHARS]
            elif isinstance(message.get("content"), list):
                message["content"] = message["content"][:2]
                for part in message["content"]:
                    part["text"] = part["text"][:TEXT_CHARS // 2]


def _outgrows_the_cache(response) -> bool:
    """A schema-valid request whose rendered prompt outgrows the small KV cache (its tools' JSON Schemas, say:
    the schema cannot bound tokens) is rightly a 400 context_length_exceeded (a CI run's tools made 2,057 tokens)."""
    return response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"


def _reaching_the_engine(body) -> None:
    """Negative cases: the model name fixed, so they pass the 404 and reach the engine; output kept short unless
    the case is about overflowing the context."""
    if not isinstance(body, dict):
        return
    body["model"] = MODEL
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and 2 < body[key] < 4096:
            body[key] = 2
    body.setdefault("max_tokens", 2)


def test_generated_requests_valid_ones_succeed_and_none_gets_a_server_error(small_disagg: Deployment):
    schema = schemathesis.openapi.from_url(small_disagg.url + "/openapi.json")
    run_seed = random.getrandbits(32)
    print(f"schemathesis: hypothesis seed {run_seed} (put it in place of random.getrandbits to replay this run)")
    refused_valid, server_errors = [], []
    seen: dict[str, int] = {}  # mode and status class -> cases, for the summary line
    operations = 0
    for result in schema.get_all_operations():
        operations += 1
        operation = result.ok()
        post = operation.method.upper() == "POST"  # the others take nothing a negative case could break
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if post else (GenerationMode.POSITIVE,):

            @seed(run_seed)
            @settings(max_examples=EXAMPLES, deadline=None, database=None,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def check(case) -> None:
                if post and isinstance(case.body, dict):
                    (_bounded if mode is GenerationMode.POSITIVE else _reaching_the_engine)(case.body)
                response = case.call(base_url=small_disagg.url, timeout=120)
                kind = f"{mode.value} {response.status_code // 100}xx"
                seen[kind] = seen.get(kind, 0) + 1
                failure = (operation.label, mode.value, case.body, response.status_code, response.text[:300])
                if response.status_code >= 500:
                    server_errors.append(failure)
                elif mode is GenerationMode.POSITIVE and not 200 <= response.status_code < 300 \
                        and not _outgrows_the_cache(response):
                    refused_valid.append(failure)

            check()
    print(f"schemathesis: {operations} operations, {sum(seen.values())} cases: "
          + ", ".join(f"{k} {v}" for k, v in sorted(seen.items())))
    assert server_errors == [], json.dumps(server_errors, ensure_ascii=True)  # whole bodies: replayable
    assert refused_valid == [], json.dumps(refused_valid, ensure_ascii=True)
    assert seen.get("positive 2xx", 0) >= 2 * EXAMPLES, seen  # the valid cases did reach the engine
    assert small_disagg.rendered_metric("dynamo_pd_prefill_fallbacks_total", reason="prefill_failed") == 0


def test_a_token_outside_the_vocabulary_is_a_400_from_the_worker_not_a_fallback(small_disagg: Deployment):
    status, body = small_disagg.post("/v1/completions", {"model": MODEL, "prompt": [1, 2, 49152], "max_tokens": 2})
    assert status == 400, body
    assert body["error"]["param"] == "prompt" and "vocabulary" in body["error"]["message"]
    assert "tcp://" not in body["error"]["message"]
    assert small_disagg.rendered_metric("dynamo_pd_prefill_fallbacks_total", reason="prefill_failed") == 0


def test_a_prompt_larger_than_the_workers_kv_cache_is_a_400_context_length_exceeded(small_disagg: Deployment):
    status, body = small_disagg.post("/v1/completions", {"model": MODEL, "prompt": [42] * 1500, "max_tokens": 2})
    assert status == 400, body
    assert body["error"]["code"] == "context_length_exceeded" and "KV cache" in body["error"]["message"]
    assert small_disagg.rendered_metric("dynamo_pd_prefill_fallbacks_total", reason="prefill_failed") == 0
