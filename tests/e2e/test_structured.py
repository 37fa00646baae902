"""Structured output across every hand-off, through the official `openai` client: 20 JSON schemas x 5 prompts,
greedy and seeded, on aggregated, 1P1D pull, 1P1D push and after a forced mid-stream migration (kill -9 of the
decode worker holding the most streams). Every output is valid against its schema (`jsonschema`) and ends by
the grammar (every schema bounds its output, so none reaches max_tokens; one that did would be counted apart
with finish_reason "length"), and each deployment's text is the aggregated text, case by case. The requests go
to every deployment at once, many in flight on each. `chat.completions.parse` with a pydantic model works."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pydantic
import pytest

from tests.e2e.conftest import MODEL, side_by_side, start_deployments

pytestmark = pytest.mark.slow

def _int(low: int, high: int) -> dict:
    return {"type": "integer", "minimum": low, "maximum": high}


def _str(n: int) -> dict:
    return {"type": "string", "maxLength": n}


def _obj(required: list[str] | None = None, **properties) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required}


SCHEMAS = [
    _obj(name=_str(12), age=_int(0, 120)),
    _obj(colour={"enum": ["red", "green", "blue"]}),
    _obj(ok={"type": "boolean"}),
    {"type": "array", "items": _int(1, 9), "minItems": 1, "maxItems": 4},
    _obj(city=_str(15), country=_str(15)),
    _obj(x=_int(-100, 100), y=_int(-100, 100)),
    _obj(score=_int(1, 5), comment=_str(20)),
    {"enum": ["yes", "no"]},
    _obj(user=_obj(id=_int(0, 999), admin={"type": "boolean"})),
    _obj(tags={"type": "array", "items": _str(8), "maxItems": 3}),
    _obj(version={"const": "1.0"}, ok={"type": "boolean"}),
    _obj(value={"anyOf": [_int(0, 9), _str(5)]}),
    _obj(["name"], name=_str(10), nickname=_str(10)),
    _obj(temperature={"type": "number", "minimum": -50, "maximum": 50}),
    _obj(result={"type": ["integer", "null"], "minimum": 0, "maximum": 9}),
    _obj(date={"type": "string", "format": "date"}),
    {"$defs": {"p": _obj(n=_int(0, 9))}, **_obj(a={"$ref": "#/$defs/p"})},
    _obj(code={"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}),
    _obj(items={"type": "array", "items": _obj(n=_int(0, 99)), "maxItems": 2}),
    _obj(answer={"enum": ["A", "B", "C", "D"]}, confidence=_int(0, 100)),
]
PROMPTS = ["Give me an example.", "Reply in JSON.", "Tell me about Paris.", "What is 2 + 2?",
           "Describe your favourite animal."]
MAX_TOKENS = 160  # beyond the longest output any of the schemas allows
IN_FLIGHT = 16  # requests a deployment has at once


def fields(s: int) -> dict:
    """The request fields that ask for schema `s`: OpenAI's response_format, or vLLM's two forms of it."""
    schema = SCHEMAS[s]
    return [{"response_format": {"type": "json_schema", "json_schema": {"name": f"s{s}", "schema": schema,
                                                                          "strict": True}}},
            {"extra_body": {"guided_json": schema}},
            {"extra_body": {"structured_outputs": {"json": schema}}}][s % 3]


CASES = [(s, p, seed) for seed in (None, 7) for s in range(len(SCHEMAS)) for p in range(len(PROMPTS))]


def ask(client, case: tuple[int, int, int | None], stream: bool, on_start=None) -> dict:
    """One case's text and finish reason; streamed, `on_start(worker, chunks_so_far)` after each chunk."""
    s, p, seed = case
    sampling = {"temperature": 0} if seed is None else {"temperature": 0.8, "seed": seed + 31 * s + p}
    body = dict(model=MODEL, messages=[{"role": "user", "content": PROMPTS[p]}], max_tokens=MAX_TOKENS,
                **sampling, **fields(s))
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        return {"text": choice.message.content, "finish": choice.finish_reason}
    raw = client.chat.completions.with_raw_response.create(stream=True, **body)
    worker, text, finish, chunks = raw.headers["x-dynamo-pd-worker"], "", None, 0
    for chunk in raw.parse():
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
            chunks += 1
            on_start(worker, chunks)
    return {"text": text, "finish": finish}


def run_cases(client) -> list[dict]:
    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        return list(pool.map(lambda case: ask(client, case, stream=False), CASES))


def check_valid(results: list[dict]) -> int:
    """Every output that ended by the grammar parses and is valid against its schema; returns how many were
    cut by max_tokens instead (counted apart)."""
    cut = 0
    for (s, p, seed), r in zip(CASES, results, strict=True):
        if r["finish"] == "length":
            cut += 1
            continue
        assert r["finish"] == "stop", r
        jsonschema.validate(json.loads(r["text"]), SCHEMAS[s])
    return cut


@pytest.fixture(scope="module")
def deployments(tmp_path_factory):
    # three deployments on two cores: a first token can take over the default minute (nothing here stalls)
    quiet = ["--health-check-interval-s", "0", "--kv-cache-memory-gb", "0.1",
             "--inter-token-timeout-s", "300"]
    with start_deployments(tmp_path_factory, {
            "aggregated": ["--aggregated", "1", *quiet], "pull": ["--prefill", "1", "--decode", "2", *quiet],
            "push": ["--prefill", "1", "--decode", "1", "--kv-handoff", "push", *quiet]},
            timeout_s=600) as started:  # six workers at once
        yield started


@pytest.mark.timeout(1500)
def test_schema_valid_json_aggregated_1p1d_pull_push_and_after_a_migration(deployments,
                                                                            openai_client_factory):
    assert len(SCHEMAS) >= 20 and len(PROMPTS) >= 5
    # a request waits behind up to IN_FLIGHT others, every deployment on two cores: more than 120 s each
    clients = {name: openai_client_factory(d).with_options(timeout=600) for name, d in deployments.items()}
    with ThreadPoolExecutor(len(deployments)) as pool:
        running = {name: pool.submit(run_cases, clients[name]) for name in deployments}
        results = {name: future.result() for name, future in running.items()}
    for name, outs in results.items():
        cut = check_valid(outs)
        assert cut == 0, f"{name}: {cut} outputs reached max_tokens {MAX_TOKENS}"
        differ = [(case, a, b) for case, a, b in zip(CASES, results["aggregated"], outs) if a != b]
        assert not differ, (name, len(differ), differ[:3])

    # the same cases streamed to 1P2D pull; the decode worker holding the most streams is killed mid-stream
    pull, counts, lock, enough = deployments["pull"], {}, threading.Lock(), threading.Event()

    def on_chunk(worker: str, chunks: int) -> None:
        if chunks == 2:  # a stream under way on `worker`
            with lock:
                counts[worker] = counts.get(worker, 0) + 1
                if counts[worker] >= IN_FLIGHT // 4:
                    enough.set()

    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        futures = [pool.submit(ask, clients["pull"], case, True, on_chunk) for case in CASES]
        assert enough.wait(600), f"no decode worker got {IN_FLIGHT // 4} streams going: {counts}; {pull.logs}"
        with lock:
            victim = max(counts, key=counts.get)
        pull.kill(victim)
        migrated = [f.result() for f in futures]
    assert check_valid(migrated) == 0
    differ = [(case, a, b) for case, a, b in zip(CASES, results["aggregated"], migrated) if a != b]
    assert not differ, (len(differ), differ[:3])
    assert pull.rendered_metric("dynamo_pd_migrations_total", reason="worker_gone") >= 1


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=120)


def test_the_openai_clients_parse_with_a_pydantic_model_works_unmodified(deployments, openai_client_factory):
    def parsed(_, d):  # pull: with the decode worker the migration test left
        return openai_client_factory(d).chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": "Invent a person."}], response_format=Person,
            temperature=0, max_tokens=MAX_TOKENS)

    for name, completion in side_by_side(deployments, parsed).items():
        assert isinstance(completion.choices[0].message.parsed, Person), (name, completion)


def test_required_and_named_tool_choices_give_schema_valid_calls_the_same_on_every_deployment(
        deployments, openai_client_factory):
    """tool_choice "required" and a named function constrain the model's output to the calls' JSON (the
    frontend's grammar, the native engine's bitmask): SmolLM2 writes valid calls, the same on every hand-off."""
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
            "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": city}},
             {"type": "function", "function": {"name": "get_time", "parameters": city}}]
    named = {"type": "function", "function": {"name": "get_time"}}

    def calls_of(name: str, d) -> list[tuple[str, str]]:
        answers = []
        for choice in ("required", named):
            completion = openai_client_factory(d).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=tools,
                tool_choice=choice, parallel_tool_calls=False, temperature=0, max_tokens=MAX_TOKENS)
            calls = completion.choices[0].message.tool_calls
            assert completion.choices[0].finish_reason == "tool_calls" and len(calls) == 1, (name, completion)
            assert calls[0].function.name in ("get_weather", "get_time"), calls
            if choice is named:
                assert calls[0].function.name == "get_time", calls
            jsonschema.validate(json.loads(calls[0].function.arguments), city)
            answers.append((calls[0].function.name, calls[0].function.arguments))
        return answers

    answers = side_by_side(deployments, calls_of)
    assert all(a == answers["aggregated"] for a in answers.values()), answers
