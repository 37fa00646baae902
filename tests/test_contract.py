"""The engine contract: request validation, the registry's errors, model resolution errors."""

import sys

import msgspec
import pytest

from dynamo_pd.engines.base import EngineUnavailableError, engine_names, load_engine_class
from dynamo_pd.handoff_kinds import PushHandoff
from dynamo_pd.model_store import ModelNotFoundError, resolve_model
from dynamo_pd.protocol import (
    EngineOutput,
    EngineRequest,
    InvalidRequestError,
    SamplingParams,
    StopConditions,
    Usage,
)


@pytest.mark.parametrize(
    ("sampling", "stop", "param"),
    [
        (SamplingParams(temperature=-0.5), StopConditions(), "temperature"),
        (SamplingParams(temperature=float("nan")), StopConditions(), "temperature"),
        (SamplingParams(top_p=0), StopConditions(), "top_p"),
        (SamplingParams(top_p=1.5), StopConditions(), "top_p"),
        (SamplingParams(top_k=-3), StopConditions(), "top_k"),
        (SamplingParams(repetition_penalty=0), StopConditions(), "repetition_penalty"),
        (SamplingParams(presence_penalty=3), StopConditions(), "presence_penalty"),
        (SamplingParams(frequency_penalty=-2.5), StopConditions(), "frequency_penalty"),
        (SamplingParams(logprobs=21), StopConditions(), "logprobs"),
        (SamplingParams(), StopConditions(max_tokens=0), "max_tokens"),
        (SamplingParams(), StopConditions(stop=[""]), "stop"),
    ],
)
def test_invalid_values_name_their_parameter(sampling, stop, param):
    request = EngineRequest(request_id="r", prompt_token_ids=[1, 2], sampling=sampling, stop=stop)
    with pytest.raises(InvalidRequestError) as info:
        request.validate()
    assert info.value.param == param
    assert param in str(info.value)


def test_empty_prompt_is_rejected():
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        EngineRequest(request_id="r", prompt_token_ids=[]).validate()


def test_valid_request_passes_and_round_trips_msgpack():
    request = EngineRequest(
        request_id="r",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=3, logprobs=2),
        stop=StopConditions(max_tokens=5, stop=["\n"], stop_token_ids=[2]),
        handoff=PushHandoff(worker_id="p", peer_endpoint="tcp://127.0.0.1:1", request_id="r", num_tokens=3),
        first_token_id=9,
    )
    request.validate()
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineRequest) == request
    out = EngineOutput(
        request_id="r", token_ids=[1], finish_reason="stop", usage=Usage(prompt_tokens=3, completion_tokens=1)
    )
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=EngineOutput) == out


def test_unknown_engine_lists_the_known_ones():
    with pytest.raises(EngineUnavailableError, match="unknown engine 'nope'.*native"):
        load_engine_class("nope")
    assert {"native", "vllm"} <= set(engine_names())


def test_missing_engine_package_names_the_extra(monkeypatch):
    # sys.modules[name] = None makes `import name` raise ModuleNotFoundError, as when it is not installed.
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.delitem(sys.modules, "dynamo_pd.engines.vllm", raising=False)
    with pytest.raises(EngineUnavailableError, match=r"dynamo-pd\[vllm\]"):
        load_engine_class("vllm")


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found"):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))


@pytest.mark.slow
def test_default_model_is_a_complete_hf_directory(model_dir):
    from safetensors import safe_open

    assert resolve_model(None) == model_dir
    assert (model_dir / "chat_template.jinja").is_file() or "chat_template" in (
        model_dir / "tokenizer_config.json"
    ).read_text()
    with safe_open(str(model_dir / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # tied, stored once
    assert sum(name.endswith("q_proj.weight") for name in names) == 30
