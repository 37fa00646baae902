"""No request field is dropped without a word: every field of OpenAI's chat and completions request schemas (read
from the `openai` package's own types) and of vLLM's (read from vLLM's own request models) is served, allowed
(no effect on output) or refused with a 400 naming it; anything else is accepted, logged once and counted."""

from __future__ import annotations

import logging

import httpx
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from transformers import AutoTokenizer

from dynamo_pd.frontend import fields
from dynamo_pd.frontend.app import FrontendConfig, create_app
from dynamo_pd.frontend.openai import ChatCompletionRequest, CompletionRequest
from dynamo_pd.metrics import Metrics
from dynamo_pd.protocol import EngineOutput

MODEL = "SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
BODIES = {"chat": ("/v1/chat/completions", CHAT), "completion": ("/v1/completions", COMPLETION)}
MODELS = {"chat": ChatCompletionRequest, "completion": CompletionRequest}

# A value that asks for something, for every refused field (the test below checks none is missing).
ASKS = {
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    "tool_choice": "required", "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "function_call": "auto", "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "hello"}, "reasoning_effort": "high", "verbosity": "low",
    "web_search_options": {}, "moderation": {"type": "auto"}, "use_beam_search": True, "length_penalty": 0.5,
    "min_p": 0.1, "min_tokens": 3, "include_stop_str_in_output": True, "skip_special_tokens": False,
    "spaces_between_special_tokens": False, "truncate_prompt_tokens": 8,
    "allowed_token_ids": [1, 2], "bad_words": ["x"], "guided_whitespace_pattern": " ", "priority": 1,
    "request_id": "r1",
    "logits_processors": ["x"], "return_tokens_as_token_ids": True, "return_token_ids": True, "cache_salt": "s",
    "kv_transfer_params": {"do_remote_decode": True}, "vllm_xargs": {"a": 1}, "mm_processor_kwargs": {"a": 1},
    "prompt_embeds": "AAAA", "add_generation_prompt": False,
    "continue_final_message": True, "documents": [{"text": "d"}], "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"enable_thinking": True}, "reasoning_parser": "deepseek_r1",
    "thinking_token_budget": 10, "repetition_detection": {"ngram": 3},
    "truncation_side": "left", "routed_experts_prompt_start": 2, "stream_interval": 4, "return_token_offsets": True,
    "watermarking": {"key": 1}, "return_mm_kwargs": True, "ec_transfer_params": {"a": 1},
    "media_io_kwargs": {"image": {}}, "logprob_token_ids": [1, 2], "mm_payload": "none", "return_prompt_text": True,
    "include_reasoning": False,
}
ASKS_ON = {("chat", "add_special_tokens"): True, ("completion", "add_special_tokens"): False}  # defaults differ
NOOPS = {"tool_choice": "none", "function_call": "none",
         "modalities": ["text"], "n": 1, "tools": [],
         "min_p": 0.0, "use_beam_search": False, "skip_special_tokens": True, "priority": 0}


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


class Backend:
    model_name, max_model_len = MODEL, 8192

    def __init__(self, tokenizer):
        self.tokenizer, self.requests = tokenizer, []

    def ready(self) -> bool:
        return True

    def refresh_metrics(self) -> None:
        pass

    async def generate(self, request, context):
        self.requests.append(request)
        yield EngineOutput(request_id=request.request_id, token_ids=[42], text="hi", finish_reason="stop")


async def post(app, path: str, body: dict) -> tuple[int, dict]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://frontend") as client:
        response = await client.post(path, json=body)
    return response.status_code, response.json()


def declared(route: str) -> set[str]:
    return set(MODELS[route].model_fields)


def openai_fields(route: str) -> set[str]:
    params = chat_create_params if route == "chat" else completion_create_params
    return set(params.CompletionCreateParamsBase.__annotations__) | {"stream"}


@pytest.mark.parametrize("route", ["chat", "completion"])
def test_every_field_of_openais_request_schema_is_served_allowed_or_refused(route):
    unclassified = openai_fields(route) - declared(route) - set(fields.REFUSED[route])
    assert unclassified == set(), f"OpenAI's {route} fields that nothing serves or refuses: {unclassified}"


@pytest.mark.slow
@pytest.mark.parametrize("route", ["chat", "completion"])
def test_every_field_of_vllms_request_schema_is_served_allowed_or_refused(route):
    if route == "chat":
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmRequest
    else:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest as VllmRequest
    unclassified = set(VllmRequest.model_fields) - declared(route) - set(fields.REFUSED[route])
    assert unclassified == set(), f"vLLM's {route} fields that nothing serves or refuses: {unclassified}"


def test_the_allowed_fields_are_declared_and_no_field_is_both_declared_and_refused():
    for route in ("chat", "completion"):
        assert set(fields.REFUSED[route]) & declared(route) == set(), route
        missing = {n for n in fields.REFUSED[route] if n not in ASKS and (route, n) not in ASKS_ON}
        assert missing == set(), f"refused fields without a value that asks for something: {missing}"
    assert {"user"} <= declared("completion")
    assert set(fields.ALLOWED) <= declared("chat")


CASES = [(route, name) for route in ("chat", "completion") for name in sorted(fields.REFUSED[route])]


@pytest.mark.parametrize("route, name", CASES)
async def test_a_refused_field_that_asks_for_something_is_a_400_naming_it(tokenizer, route, name):
    backend = Backend(tokenizer)
    path, body = BODIES[route]
    status, answer = await post(
        create_app(backend, FrontendConfig()), path, {**body, name: ASKS_ON.get((route, name), ASKS.get(name))}
    )
    assert status == 400, answer
    assert answer["error"]["param"] == name and name in answer["error"]["message"], answer
    assert answer["error"]["type"] == "invalid_request_error"
    assert backend.requests == []


@pytest.mark.parametrize("route, name, value", [(route, name, value) for route in ("chat", "completion")
                                                for name, value in NOOPS.items()
                                                if name in fields.REFUSED[route] or name in declared(route)])
async def test_a_field_sent_with_the_value_that_asks_for_nothing_is_served(tokenizer, route, name, value):
    backend = Backend(tokenizer)
    path, body = BODIES[route]
    status, answer = await post(create_app(backend, FrontendConfig()), path, {**body, name: value})
    assert status == 200, answer
    assert len(backend.requests) == 1


async def test_allowed_fields_are_accepted_and_change_nothing_the_engine_is_asked(tokenizer):
    plain, allowed = Backend(tokenizer), Backend(tokenizer)
    given = {"user": "u1", "metadata": {"team": "a"}, "store": True, "service_tier": "auto",
             "safety_identifier": "s", "prompt_cache_key": "k", "prompt_cache_options": {}, "prompt_cache_retention":
             "24h", "session_id": "conversation-1",
             "stream_options": None}
    assert set(given) - {"stream_options"} == set(fields.ALLOWED)
    assert (await post(create_app(plain, FrontendConfig()), "/v1/chat/completions", CHAT))[0] == 200
    status, answer = await post(create_app(allowed, FrontendConfig()), "/v1/chat/completions", {**CHAT, **given})
    assert status == 200, answer
    [a], [b] = plain.requests, allowed.requests
    assert (a.prompt_token_ids, a.sampling, a.stop) == (b.prompt_token_ids, b.sampling, b.stop)


async def test_an_unknown_field_is_accepted_logged_once_and_counted(tokenizer, caplog):
    metrics = Metrics()
    app = create_app(Backend(tokenizer), FrontendConfig(), metrics)
    with caplog.at_level(logging.WARNING, logger="dynamo_pd.frontend"):
        for _ in range(3):
            status, answer = await post(app, "/v1/completions", {**COMPLETION, "my_custom_knob": 7})
            assert status == 200, answer
    logged = [r for r in caplog.records if "my_custom_knob" in r.getMessage()]
    assert len(logged) == 1
    text = metrics.render().decode()
    assert 'dynamo_pd_request_fields_unknown_total{field="my_custom_knob",route="completion"} 3.0' in text


async def test_unknown_field_names_beyond_the_cap_count_as_other(tokenizer):
    metrics = Metrics()
    app = create_app(Backend(tokenizer), FrontendConfig(), metrics)
    for i in range(fields._MAX_LABELS + 3):
        assert (await post(app, "/v1/completions", {**COMPLETION, f"knob_{i}": 1}))[0] == 200
    text = metrics.render().decode()
    assert text.count("dynamo_pd_request_fields_unknown_total{") == fields._MAX_LABELS + 1
    assert 'dynamo_pd_request_fields_unknown_total{field="(other)",route="completion"} 3.0' in text


async def test_vllms_continuous_usage_stats_is_refused_by_name(tokenizer):
    backend = Backend(tokenizer)
    body = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    status, answer = await post(create_app(backend, FrontendConfig()), "/v1/completions", body)
    assert status == 400 and answer["error"]["param"] == "stream_options.continuous_usage_stats", answer
    assert backend.requests == []


async def test_message_keys_beyond_role_and_content_reach_the_chat_template(tokenizer):
    """As vLLM and transformers hand them: the model's template decides (here one that prints `name`)."""
    named = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    named.chat_template = "{% for m in messages %}{{ m['name'] }}: {{ m['content'] }}\n{% endfor %}"
    backend = Backend(named)
    messages = [{"role": "user", "name": "Ada", "content": "hi"}]
    status, answer = await post(create_app(backend, FrontendConfig()), "/v1/chat/completions",
                                {**CHAT, "messages": messages})
    assert status == 200, answer
    assert named.decode(backend.requests[0].prompt_token_ids) == "Ada: hi\n"
