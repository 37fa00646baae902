"""n > 1, best_of, logit_bias, echo, prompt_logprobs and suffix through the HTTP frontend with the unmodified
`openai` client, over the real RemoteBackend, real RPC servers and real mocker engines (which fork choices,
bias and score prompts as the native engine does, without a model to compute): each field honoured, or a 400
naming it. Choices stream interleaved with their index, usage counts the prompt once and every choice's tokens;
best_of answers the n choices of highest cumulative logprob; tool calls and structured output hold per choice;
n > 1 is retried before its first token and not migrated after. The native engine's parity across hand-offs is
tests/e2e/test_n_best.py's."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import httpx
import jsonschema
import msgspec
import openai
import pytest
from transformers import AutoTokenizer

from dynamo_pd.engines.base import EngineConfig
from dynamo_pd.engines.http import HttpEngine
from dynamo_pd.engines.llamacpp import LlamaCppEngine
from dynamo_pd.engines.mocker.engine import MockerEngine
from dynamo_pd.frontend.app import FrontendConfig, create_app
from dynamo_pd.frontend.backend import BackendConfig, RemoteBackend
from dynamo_pd.frontend.openai import fim_tokens
from dynamo_pd.metrics import Metrics
from dynamo_pd.protocol import EngineRequest, InvalidRequestError, SamplingParams, WorkerInfo
from dynamo_pd.runtime import RequestContext, RpcServer
from router.service import KvRouter, RouterConfig
from router.worker import Role

pytestmark = pytest.mark.slow  # the served model's tokenizer and config
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Count from one to ten: one, two,"
ASK = [{"role": "user", "content": "Name three colors."}]
_decode = msgspec.msgpack.Decoder(EngineRequest)
_encode = msgspec.msgpack.Encoder()


@dataclass
class Worker:
    """A mocker engine behind a real RPC server, checked first as a worker checks every request. `die_after`:
    it closes its server (the process dies) after that many outputs of the first request it serves."""

    engine: MockerEngine
    die_after: int | None = None
    server: RpcServer | None = None
    served: int = 0

    async def handler(self, payload: bytes, context: RequestContext):
        request = _decode.decode(payload)
        self.engine.check_served(request)
        self.served += 1
        dies = self.die_after is not None and self.served == 1
        async for sent, out in _counted(self.engine.generate(request, context)):
            if dies and sent == self.die_after:
                asyncio.get_running_loop().create_task(self.server.close())
                await asyncio.sleep(30)
            yield _encode.encode(out)


async def _counted(stream):
    sent = 0
    async for out in stream:
        yield sent, out
        sent += 1


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture
async def deploy(tokenizer):
    """deploy(*die_after) -> (openai client, backend): a frontend over one aggregated mocker worker each."""
    made: list[tuple[Worker, RemoteBackend]] = []

    async def make(*die_after: int | None) -> tuple[openai.AsyncOpenAI, RemoteBackend]:
        router = KvRouter(RouterConfig(block_size=16, policy="round_robin"))
        backend = RemoteBackend(MODEL, tokenizer, 8192, None, None, router, Metrics(), BackendConfig())
        for i, die in enumerate(die_after or (None,)):
            engine = MockerEngine(EngineConfig(num_kv_blocks=512, extra={"speedup": 1000.0}))
            await engine.start()
            worker = Worker(engine, die)
            worker.server = RpcServer(worker.handler)
            await worker.server.start()
            made.append((worker, backend))
            router.add_worker(f"w{i}", Role.AGGREGATED, capacity_blocks=512, block_size=16)
            backend.workers[f"w{i}"] = WorkerInfo(worker_id=f"w{i}", role=Role.AGGREGATED, engine="mocker",
                                                  model=MODEL, rpc_endpoint=worker.server.endpoint, resumes=True)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(backend, FrontendConfig())),
                                 base_url="http://frontend/v1")
        return openai.AsyncOpenAI(api_key="none", base_url="http://frontend/v1", http_client=http), backend

    yield make
    for worker, backend in made:
        await backend.rpc.close()
        await worker.server.close()
        await worker.engine.stop()


async def post(client: openai.AsyncOpenAI, path: str, body: dict) -> tuple[int, dict]:
    response = await client._client.post(path, json={"model": MODEL, **body})
    return response.status_code, response.json()


async def streamed(client: openai.AsyncOpenAI, path: str, body: dict) -> list[str]:
    """The `data:` payloads of a streamed answer, [DONE] included."""
    async with client._client.stream("POST", path, json={"model": MODEL, "stream": True, **body}) as response:
        assert response.status_code == 200, await response.aread()
        return [line[len("data: "):] async for line in response.aiter_lines() if line.startswith("data: ")]


async def test_n_choices_whole_and_streamed_chat_and_completion(deploy, tokenizer):
    client, _ = await deploy()
    whole = await client.completions.create(model=MODEL, prompt=PROMPT, n=3, max_tokens=6, temperature=1.0, seed=5)
    assert [c.index for c in whole.choices] == [0, 1, 2] and len({c.text for c in whole.choices}) == 3
    prompt_tokens = len(tokenizer(PROMPT).input_ids)
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_tokens, 18)  # the prompt once
    events = await streamed(client, "/completions", {"prompt": PROMPT, "n": 3, "max_tokens": 6, "temperature": 1.0,
                                                     "seed": 5, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    texts, finished = {0: "", 1: "", 2: ""}, []
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["text"]
            if choice["finish_reason"]:
                finished.append(choice["index"])
    assert texts == {c.index: c.text for c in whole.choices}
    assert sorted(finished) == [0, 1, 2]
    order = [c["index"] for chunk in chunks for c in chunk["choices"]]
    assert order != sorted(order), "the choices' chunks interleave"
    (usage,) = [chunk["usage"] for chunk in chunks if chunk.get("usage")]
    assert usage == {**usage, "prompt_tokens": whole.usage.prompt_tokens, "completion_tokens": 18}

    chat = await client.chat.completions.create(model=MODEL, messages=ASK, n=2, max_tokens=5, temperature=1.0,
                                                seed=8, logprobs=True, top_logprobs=1)
    assert [c.index for c in chat.choices] == [0, 1] and chat.choices[0].message.content != \
        chat.choices[1].message.content
    assert all(len(c.logprobs.content) == 5 for c in chat.choices) and chat.usage.completion_tokens == 10
    stream = await client.chat.completions.create(model=MODEL, messages=ASK, n=2, max_tokens=5, temperature=1.0,
                                                  seed=8, stream=True)
    got, roles = {0: "", 1: ""}, []
    async for chunk in stream:
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.index)
            got[c.index] += c.delta.content or ""
    assert sorted(roles) == [0, 1] and got == {c.index: c.message.content for c in chat.choices}


async def test_choice_i_is_the_answer_seeded_seed_plus_i(deploy):
    client, _ = await deploy()
    many = await client.completions.create(model=MODEL, prompt=PROMPT, n=3, max_tokens=6, temperature=1.0, seed=40)
    for i in range(3):
        one = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=40 + i)
        assert one.choices[0].text == many.choices[i].text


async def test_best_of_answers_the_n_of_highest_cumulative_logprob(deploy):
    client, _ = await deploy()
    every = await client.completions.create(model=MODEL, prompt=PROMPT, n=4, max_tokens=5, temperature=1.0, seed=2,
                                            logprobs=0)
    totals = sorted(((sum(c.logprobs.token_logprobs), c.text) for c in every.choices), reverse=True)
    best = await client.completions.create(model=MODEL, prompt=PROMPT, n=2, best_of=4, max_tokens=5,
                                           temperature=1.0, seed=2)
    assert [c.text for c in best.choices] == [text for _, text in totals[:2]]
    assert [c.index for c in best.choices] == [0, 1] and all(c.logprobs is None for c in best.choices)
    assert best.usage.completion_tokens == 20  # every generated choice's tokens
    shown = await client.completions.create(model=MODEL, prompt=PROMPT, n=2, best_of=4, max_tokens=5,
                                            temperature=1.0, seed=2, logprobs=1)
    assert [c.text for c in shown.choices] == [c.text for c in best.choices] and shown.choices[0].logprobs
    for body, param in (({"n": 3, "best_of": 2}, "best_of"), ({"n": 1, "best_of": 2, "stream": True}, "best_of"),
                        ({"n": 129}, "n"), ({"best_of": 0}, "best_of")):
        status, answer = await post(client, "/completions", {"prompt": PROMPT, **body})
        assert status == 400 and answer["error"]["param"] == param, (body, answer)


async def test_echo_puts_the_prompt_and_its_logprobs_first(deploy, tokenizer):
    client, _ = await deploy()
    ids = tokenizer(PROMPT).input_ids
    plain = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1)
    echoed = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1,
                                             echo=True, n=2)
    for choice in echoed.choices:
        assert choice.text == PROMPT + plain.choices[0].text
        lp = choice.logprobs
        assert lp.tokens == [tokenizer.decode(t) for t in ids] + plain.choices[0].logprobs.tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(isinstance(v, float) for v in lp.token_logprobs[1:])
        assert lp.token_logprobs[len(ids):] == plain.choices[0].logprobs.token_logprobs
    as_ids = await client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, echo=True)
    assert as_ids.choices[0].text == tokenizer.decode(ids) + plain.choices[0].text
    events = await streamed(client, "/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                                     "echo": True, "logprobs": 1})
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert chunks[0]["text"].startswith(PROMPT) and chunks[0]["logprobs"]["token_logprobs"][0] is None
    assert "".join(c["text"] for c in chunks) == echoed.choices[0].text
    assert [t for c in chunks for t in c["logprobs"]["tokens"]] == echoed.choices[0].logprobs.tokens
    chat_echo = await client.chat.completions.create(
        model=MODEL, max_tokens=3, temperature=0, extra_body={"echo": True},
        messages=[*ASK, {"role": "assistant", "content": "Red,"}])
    assert chat_echo.choices[0].message.content.startswith("Red,")


async def test_prompt_logprobs_as_vllm_answers_them(deploy, tokenizer):
    client, _ = await deploy()
    ids = tokenizer(PROMPT).input_ids
    status, answer = await post(client, "/completions", {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 2})
    assert status == 200, answer
    scores = answer["choices"][0]["prompt_logprobs"]
    assert len(scores) == len(ids) and scores[0] is None
    for token, entry in zip(ids[1:], scores[1:]):
        assert str(token) in entry and 2 <= len(entry) <= 3
        assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())
    status, chat = await post(client, "/chat/completions", {"messages": ASK, "max_tokens": 2, "prompt_logprobs": 0})
    assert status == 200 and chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 5
    status, answer = await post(client, "/completions", {"prompt": PROMPT, "stream": True, "prompt_logprobs": 1})
    assert status == 400 and answer["error"]["param"] == "prompt_logprobs", answer


async def test_bad_logit_biases_are_400s_naming_it(deploy):
    client, _ = await deploy()
    for body in ({"logit_bias": {str(i): 1 for i in range(301)}}, {"logit_bias": {"42": 101}},
                 {"logit_bias": {"forty-two": 1}}, {"logit_bias": {"49152": 1}}):
        status, answer = await post(client, "/completions", {"prompt": PROMPT, "max_tokens": 2, **body})
        assert status == 400 and answer["error"]["param"] == "logit_bias", (body, answer)


async def test_logit_bias_bans_and_forces_tokens(deploy, tokenizer):
    client, _ = await deploy()
    plain = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    ids = tokenizer(plain.choices[0].text, add_special_tokens=False).input_ids
    banned = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                             logit_bias={str(ids[0]): -100})
    assert tokenizer(banned.choices[0].text, add_special_tokens=False).input_ids[0] != ids[0]
    forced = await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, temperature=0,
                                                  logit_bias={str(ids[1]): 100})
    assert forced.choices[0].message.content == tokenizer.decode([ids[1]] * 3)


async def test_structured_output_and_tool_calls_hold_in_every_choice(deploy):
    client, _ = await deploy()
    # closed values: the mocker picks any allowed token, so a free string would run to max_tokens
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue", "cyan", "white"]},
                                               "big": {"type": "boolean"}},
              "required": ["color", "big"], "additionalProperties": False}
    answer = await client.chat.completions.create(
        model=MODEL, messages=ASK, n=3, max_tokens=60, temperature=1.0, seed=4,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}})
    contents = [c.message.content for c in answer.choices]
    for content in contents:
        jsonschema.validate(json.loads(content), schema)
    assert len(set(contents)) > 1, "each choice its own matcher, its own draws"
    # a hermes call the grammar writes (SmolLM2's default parser): each choice's output read by its own parser
    tools = [{"type": "function", "function": {"name": "paint", "parameters": schema}}]
    call = (r'<tool_call>\n\{"name": "paint", "arguments": \{"color": "(red|green|blue|cyan|white)", '
            r'"big": (true|false)\}\}\n</tool_call>')
    asked = dict(model=MODEL, messages=ASK, n=3, max_tokens=80, temperature=1.0, seed=6, tools=tools,
                 extra_body={"guided_regex": call})
    called = await client.chat.completions.create(**asked)
    arguments = []
    for choice in called.choices:
        assert choice.finish_reason == "tool_calls" and not choice.message.content, choice
        (made,) = choice.message.tool_calls
        assert made.function.name == "paint"
        arguments.append(json.loads(made.function.arguments))
        jsonschema.validate(arguments[-1], schema)
    assert len({json.dumps(a) for a in arguments}) > 1
    streamed_calls: dict[int, str] = {}
    async for chunk in await client.chat.completions.create(**asked, stream=True):
        for c in chunk.choices:
            for delta in c.delta.tool_calls or []:
                streamed_calls[c.index] = streamed_calls.get(c.index, "") + (delta.function.arguments or "")
    assert {i: json.loads(a) for i, a in streamed_calls.items()} == dict(enumerate(arguments))


async def test_n_choices_are_retried_before_their_first_token_and_not_migrated_after(deploy, caplog):
    client, backend = await deploy(0, None)  # the first worker dies before its first output
    answer = await client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=5, temperature=1.0, seed=3)
    assert len(answer.choices) == 2 and answer.usage.completion_tokens == 10
    assert backend.metrics.retries.labels("worker_gone")._value.get() == 1
    client, backend = await deploy(3, None)  # ... after three outputs
    status, error = await post(client, "/completions", {"prompt": PROMPT, "n": 2, "max_tokens": 5})
    assert status == 503 and error["error"]["code"] == "worker_unavailable", error
    assert "2 choices (n) do not migrate" in caplog.text
    assert backend.metrics.migrations.labels("worker_gone")._value.get() == 0


def test_an_engine_that_cannot_fork_bias_or_score_refuses_naming_the_field():
    http = HttpEngine(EngineConfig(extra={"url": "http://127.0.0.1:9/v1"}))
    for sampling, param in ((SamplingParams(n=2), "n"), (SamplingParams(logit_bias={1: 1.0}), "logit_bias"),
                            (SamplingParams(prompt_logprobs=1), "prompt_logprobs")):
        with pytest.raises(InvalidRequestError) as err:
            http.check_served(EngineRequest(request_id="r", prompt_token_ids=[1], sampling=sampling))
        assert err.value.param == param and "HttpEngine" in str(err.value)
    assert (LlamaCppEngine.forks, LlamaCppEngine.logit_bias) == (False, True)  # its sampler is the native one's
    http.check_served(EngineRequest(request_id="r", prompt_token_ids=[1]))


async def test_suffix_fills_in_the_middle_where_the_model_has_fim_tokens_else_a_400_saying_why(deploy, tokenizer):
    client, _ = await deploy()
    status, answer = await post(client, "/completions", {"prompt": "def f(", "suffix": "    return x\n"})
    assert status == 400 and answer["error"]["param"] == "suffix" and "FIM tokens" in answer["error"]["message"]
    assert (await post(client, "/completions", {"prompt": PROMPT, "suffix": "", "max_tokens": 1}))[0] == 200
    fim = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    fim.add_special_tokens({"additional_special_tokens": ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]})
    pre, suf, mid = fim_tokens(fim)
    from dynamo_pd.frontend.openai import CompletionRequest

    ids = CompletionRequest(model=MODEL, prompt="def f(", suffix="    return x\n").prompt_ids(fim)
    assert ids == [pre, *fim("def f(").input_ids, suf, *fim("    return x\n").input_ids, mid]
