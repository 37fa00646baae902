"""Tool calls through the HTTP frontend with the unmodified `openai` client: tools rendered into the prompt
(the model's template, or the fallback for SmolLM2's, which has no tools section), tool_choice and
parallel_tool_calls, calls read out of the output whole and streamed, reasoning split off. The backend replays
a fixed model output token by token, as an engine streams it (its text decoded without special tokens, as the
native engine's is): the frontend's reading of it is what is tested."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from tokenizers import AddedToken
from transformers import AutoTokenizer

from dynamo_pd.frontend.app import FrontendConfig, create_app
from dynamo_pd.frontend.tokenizer import load_tokenizer
from dynamo_pd.frontend.tools import prompt
from dynamo_pd.protocol import EngineOutput, Usage

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
ASK = [{"role": "user", "content": "Weather in Paris and Rome?"}]
CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')


class Replay:
    """A backend whose model writes `output`, one token per step."""

    model_name, max_model_len = MODEL, 8192

    def __init__(self, tokenizer, output: str):
        self.tokenizer, self.output, self.prompts = tokenizer, output, []

    def ready(self) -> bool:
        return True

    def refresh_metrics(self) -> None:
        pass

    async def generate(self, request, context):
        self.prompts.append(self.tokenizer.decode(request.prompt_token_ids))
        ids = self.tokenizer(self.output).input_ids if self.output else []
        for token in ids:
            yield EngineOutput(request_id=request.request_id, token_ids=[token],
                               text=self.tokenizer.decode([token], skip_special_tokens=True))
        yield EngineOutput(request_id=request.request_id, token_ids=[], finish_reason="stop",
                           usage=Usage(prompt_tokens=len(request.prompt_token_ids),
                                       completion_tokens=len(ids)))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)[0]


def client(backend, **config) -> openai.AsyncOpenAI:
    app = create_app(backend, FrontendConfig(**config))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://frontend/v1")
    return openai.AsyncOpenAI(api_key="none", base_url="http://frontend/v1", http_client=http)


async def test_calls_come_back_as_message_tool_calls(tokenizer):
    answer = await client(Replay(tokenizer, CALLS)).chat.completions.create(model=MODEL, messages=ASK,
                                                                             tools=TOOLS)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert all(c.type == "function" and c.id.startswith("call_") for c in choice.message.tool_calls)
    assert len({c.id for c in choice.message.tool_calls}) == 2


async def test_streamed_calls_are_openai_deltas_that_join_to_the_calls(tokenizer):
    chunks = [c async for c in await client(Replay(tokenizer, CALLS)).chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, stream=True)]
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.index not in calls:
            assert d.id and d.type == "function" and d.function.name, d
            calls[d.index] = [d.function.name, d.function.arguments or ""]
        else:
            assert d.id is None and d.function.name is None
            calls[d.index][1] += d.function.arguments
    assert [(n, json.loads(a)) for n, a in calls.values()] == \
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert len(deltas) > 4  # the arguments came in pieces
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(not c.choices[0].delta.content for c in chunks)


async def test_without_a_call_the_answer_is_content(tokenizer):
    answer = await client(Replay(tokenizer, "It is sunny in Paris.")).chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS)
    assert answer.choices[0].message.content == "It is sunny in Paris."
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason == "stop"


async def test_smollm2s_template_gets_the_fallback_prompt_equal_to_chatml_tools_jinja(tokenizer, model_dir):
    """The fallback rendered through SmolLM2's own template is, token for token, what transformers (as vLLM)
    renders from chatml_tools.jinja, the template benchmarks/bfcl.py hands vLLM's server."""
    backend = Replay(tokenizer, "ok")
    history = [{"role": "system", "content": "Be brief."}, *ASK,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                     "arguments": '{"city": "Paris"}'}},
                   {"id": "call_2", "type": "function", "function": {"name": "get_weather",
                                                                     "arguments": '{"city": "Rome"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
               {"role": "tool", "tool_call_id": "call_2", "content": "21C"}]
    for messages in (ASK, history):
        await client(backend).chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        hf = AutoTokenizer.from_pretrained(model_dir)
        jinja = (prompt.__file__.rsplit("/", 1)[0]) + "/chatml_tools.jinja"
        expected = hf.apply_chat_template(prompt.template_messages(messages), tools=TOOLS, tokenize=False,
                                          add_generation_prompt=True, chat_template=open(jinja).read())
        assert backend.prompts[-1] == expected
    assert "<tools>\n" + json.dumps(TOOLS[0]) in backend.prompts[-1]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in \
        backend.prompts[-1]
    results = "<tool_response>\n18C\n</tool_response>\n<tool_response>\n21C\n</tool_response>"
    assert f"<|im_start|>user\n{results}<|im_end|>" in backend.prompts[-1]


async def test_a_template_with_a_tools_section_gets_the_tools(model_dir):
    tokenizer, _ = load_tokenizer(model_dir)
    tokenizer.chat_template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
                               "{{ messages[0].content }}")
    tokenizer._template = tokenizer._template.environment.from_string(tokenizer.chat_template)
    backend = Replay(tokenizer, "ok")
    await client(backend).chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    assert backend.prompts[-1] == "[get_weather][search]" + ASK[0]["content"]


async def test_tool_choice_none_renders_no_tools_and_reads_no_calls(tokenizer):
    backend = Replay(tokenizer, CALLS)
    answer = await client(backend).chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                           tool_choice="none")
    assert "<tools>" not in backend.prompts[-1]
    assert answer.choices[0].message.content == CALLS and answer.choices[0].message.tool_calls is None


async def test_parallel_tool_calls_false_keeps_the_first_call(tokenizer):
    for stream in (False, True):
        answer = await client(Replay(tokenizer, CALLS)).chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, parallel_tool_calls=False, stream=stream)
        if stream:
            chunks = [c async for c in answer]
            names = [d.index for c in chunks for d in (c.choices[0].delta.tool_calls or []) if d.id]
            assert names == [0]
        else:
            assert len(answer.choices[0].message.tool_calls) == 1


async def test_a_named_choice_that_is_not_a_tool_is_a_400_naming_tool_choice(tokenizer):
    with pytest.raises(openai.BadRequestError) as caught:
        await client(Replay(tokenizer, CALLS)).chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}})
    assert caught.value.body["param"] == "tool_choice"


class Recording(Replay):
    def __init__(self, tokenizer, output: str):
        super().__init__(tokenizer, output)
        self.requests = []

    def generate(self, request, context):
        self.requests.append(request)
        return super().generate(request, context)


async def test_required_and_named_choices_constrain_the_output_to_their_calls_json(tokenizer):
    """The engine gets the calls' JSON schema as its grammar (a "required" list of {name, parameters}, or the
    named function's parameters), and the answer is read as calls."""
    cases = [("required", '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'),
             ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Paris"}')]
    for choice, output in cases:
        backend = Recording(tokenizer, output)
        answer = await client(backend).chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                               tool_choice=choice)
        guided = backend.requests[-1].sampling.guided
        assert guided is not None and (guided.kind, guided.param) == ("json_schema", "tool_choice")
        schema = json.loads(guided.spec)
        if choice == "required":
            assert schema["type"] == "array" and schema["minItems"] == 1
            assert [o["properties"]["parameters"] for o in schema["items"]["anyOf"]] == \
                [WEATHER, {"type": "object"}]
        else:
            assert schema == WEATHER
        calls = answer.choices[0].message.tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
            [("get_weather", {"city": "Paris"})]
    with pytest.raises(openai.BadRequestError) as caught:  # two constraints on one output
        await client(Recording(tokenizer, "{}")).chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    assert caught.value.body["param"] == "tool_choice"
    backend = Recording(tokenizer, CALLS)
    await client(backend).chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto")
    assert backend.requests[-1].sampling.guided is None


async def test_special_token_markers_the_engine_leaves_out_of_its_text_are_read_from_token_ids(model_dir):
    tokenizer, _ = load_tokenizer(model_dir)
    tokenizer._tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                             for t in ("[TOOL_CALLS]", "[ARGS]")])
    output = 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    for stream in (False, True):
        backend = Replay(tokenizer, output)
        answer = await client(backend, tool_call_parser="mistral").chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, stream=stream)
        if stream:
            chunks = [c async for c in answer]
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
            calls = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
            name, arguments = calls[0].function.name, "".join(d.function.arguments or "" for d in calls)
            ids = [d.id for d in calls if d.id]
        else:
            message = answer.choices[0].message
            content, name, arguments = message.content, message.tool_calls[0].function.name, \
                message.tool_calls[0].function.arguments
            ids = [message.tool_calls[0].id]
        assert (content, name, json.loads(arguments)) == ("Sure.", "get_weather", {"city": "Paris"})
        assert len(ids) == 1 and len(ids[0]) == 9 and ids[0].isalnum()  # Mistral's own id form


async def test_the_reasoning_parser_splits_think_into_reasoning_content(tokenizer):
    output = "<think>The user wants weather.</think>It is sunny."
    answer = await client(Replay(tokenizer, output), reasoning_parser="think").chat.completions.create(
        model=MODEL, messages=ASK)
    message = answer.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == \
        ("The user wants weather.", "It is sunny.")
    streamed = await client(Replay(tokenizer, output), reasoning_parser="think").chat.completions.create(
        model=MODEL, messages=ASK, stream=True)
    chunks = [c async for c in streamed]
    assert "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks) == \
        "The user wants weather."
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "It is sunny."
    plain = await client(Replay(tokenizer, output)).chat.completions.create(model=MODEL, messages=ASK)
    assert plain.choices[0].message.content == output  # off unless asked for
