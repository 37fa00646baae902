"""Structured output on the other engines, each in its own form: vLLM's StructuredOutputsParams, SGLang's
sampling params (checked by its real SamplingParams), TensorRT-LLM's GuidedDecodingParams (fakes shaped like
its classes, tests/engines/test_trtllm.py) with its xgrammar backend on; llama.cpp through the native
sampler's grammar over the GGUF's vocabulary, handed off prefill -> decode unchanged; the engines without
support (http, mistral.rs) refuse with a 400 naming the request's field before any work."""

from __future__ import annotations

import json

import jsonschema
import msgspec
import pytest

from dynamo_pd.engines.base import EngineConfig, EngineRole
from dynamo_pd.guided import KINDS, choice_ebnf
from dynamo_pd.protocol import EngineRequest, Guided, InvalidRequestError, SamplingParams, StopConditions
from tests.engines.test_trtllm import GuidedDecodingParams, trtllm  # noqa: F401 - the fixture

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
TAG = json.dumps({"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}})
GUIDES = {
    "json_schema": Guided(kind="json_schema", spec=SCHEMA),
    "json_object": Guided(kind="json_object"),
    "regex": Guided(kind="regex", spec="[a-c]+", param="guided_regex"),
    "choice": Guided(kind="choice", spec='["yes", "no"]', param="guided_choice"),
    "grammar": Guided(kind="grammar", spec='root ::= "x"', param="guided_grammar"),
    "structural_tag": Guided(kind="structural_tag", spec=TAG, param="structural_tag"),
}


def request(guided: Guided | None) -> EngineRequest:
    return EngineRequest(request_id="r-1", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(guided=guided),
                         stop=StopConditions(max_tokens=8))


def test_every_kind_is_covered_here():
    assert set(GUIDES) == KINDS


@pytest.mark.vllm
def test_vllm_gets_its_structured_outputs_params():
    from vllm.sampling_params import StructuredOutputsParams

    from dynamo_pd.engines.vllm import VllmEngine

    e = VllmEngine(EngineConfig())
    assert e.guided_kinds == KINDS
    expected = {
        "json_schema": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        "json_object": StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
        "regex": StructuredOutputsParams(regex="[a-c]+"),
        "choice": StructuredOutputsParams(choice=["yes", "no"]),
        "grammar": StructuredOutputsParams(grammar='root ::= "x"'),
        "structural_tag": StructuredOutputsParams(structural_tag=TAG),
    }
    for kind, guided in GUIDES.items():
        assert e._sampling_params(request(guided)).structured_outputs == expected[kind], kind
    assert e._sampling_params(request(None)).structured_outputs is None


def test_sglang_gets_its_sampling_params_and_its_own_class_takes_them():
    from tests.engines.test_sglang import SglSamplingParams, engine  # skips where sglang is not installed
    from dynamo_pd.engines.base import EngineRole

    e = engine(EngineRole.AGGREGATED)
    expected = {"json_schema": ("json_schema", SCHEMA), "json_object": ("json_schema", '{"type": "object"}'),
                "regex": ("regex", "[a-c]+"), "choice": ("ebnf", choice_ebnf(["yes", "no"])),
                "grammar": ("ebnf", 'root ::= "x"'), "structural_tag": ("structural_tag", TAG)}
    for kind, guided in GUIDES.items():
        sampling = SglSamplingParams(**e.generate_args(request(guided))["sampling_params"])
        sampling.verify(vocab_size=49152)  # its own check: one constraint at most
        field, value = expected[kind]
        assert getattr(sampling, field) == value, kind
        constraints = ("json_schema", "regex", "ebnf", "structural_tag")
        assert [f for f in constraints if getattr(sampling, f)] == [field]


def test_trtllm_gets_guided_decoding_params_on_its_xgrammar_backend(trtllm):  # noqa: F811
    from tests.engines.test_trtllm import engine
    from dynamo_pd.engines.base import EngineRole

    e = engine(trtllm, EngineRole.AGGREGATED)
    assert e.llm_args()["guided_decoding_backend"] == "xgrammar"
    assert engine(trtllm, EngineRole.AGGREGATED, guided_decoding_backend="llguidance").llm_args()[
        "guided_decoding_backend"] == "llguidance"  # extra wins, as for every LLM argument
    expected = {"json_schema": GuidedDecodingParams(json=SCHEMA),
                "json_object": GuidedDecodingParams(json_object=True),
                "regex": GuidedDecodingParams(regex="[a-c]+"),
                "choice": GuidedDecodingParams(grammar=choice_ebnf(["yes", "no"])),
                "grammar": GuidedDecodingParams(grammar='root ::= "x"'),
                "structural_tag": GuidedDecodingParams(structural_tag=TAG)}
    for kind, guided in GUIDES.items():
        assert e.sampling_params(request(guided)).guided_decoding == expected[kind], kind
    assert e.sampling_params(request(None)).guided_decoding is None


def refusals():
    from dynamo_pd.engines.http import HttpEngine
    from dynamo_pd.engines.mistralrs import MistralRsEngine

    http = HttpEngine(EngineConfig(extra={"url": "http://127.0.0.1:9/v1"}))
    yield "http", http._body
    yield "mistralrs", MistralRsEngine(EngineConfig())._prompt_text


def test_engines_without_support_refuse_naming_the_field():
    for name, check in refusals():
        for guided in GUIDES.values():
            with pytest.raises(InvalidRequestError) as err:
                check(request(guided))
            assert err.value.param == guided.param and guided.kind in str(err.value), name


@pytest.mark.slow
async def test_llamacpp_samples_under_the_grammar_and_hands_it_off_unchanged(monkeypatch):
    """Its own engine in each role (tests/engines/test_llamacpp.py's), every request under one schema."""
    from tests.engines import test_llamacpp as lc

    schema = {"type": "object", "properties": {"river": {"type": "string", "maxLength": 12},
                                               "km": {"type": "integer", "minimum": 0, "maximum": 9999}},
              "required": ["river", "km"]}
    guided = Guided(kind="json_schema", spec=json.dumps(schema))
    plain = lc.request

    def under_schema(engine, rid: str, text: str = lc.PROMPT, **kwargs) -> EngineRequest:
        req = plain(engine, rid, text, max_tokens=64, **kwargs)
        return msgspec.structs.replace(req, sampling=msgspec.structs.replace(req.sampling, guided=guided))

    monkeypatch.setattr(lc, "request", under_schema)  # what Pair.run asks with
    agg = await lc.started(EngineRole.AGGREGATED)
    try:
        for sampling in ({}, {"temperature": 0.8, "seed": 5}):
            expected = lc.said(await lc.collect(agg, under_schema(agg, "agg", **sampling)))
            text, _, finish = expected
            assert finish == "stop", expected
            jsonschema.validate(json.loads(text), schema)
            async with lc.Pair() as pair:
                for mode in ("pull", "push"):
                    assert lc.said(await pair.run(f"{mode}-{sampling}", mode, **sampling)) == expected, mode
    finally:
        await agg.stop()
