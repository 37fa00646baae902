"""A GGUF's cached conversion (the default model's here) is a complete Hugging Face directory: what
transformers' save_pretrained writes, which transformers loads and runs as it would a checkout from the Hub
(vLLM: tests/test_vllm_engine.py, on its shared engine). Its config.json had no `architectures`: NVIDIA
Dynamo's frontend refused it, and vLLM took it for the headless LlamaModel; a cache an older version wrote
so is converted again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dynamo_pd.llm import LLM
from dynamo_pd.model_store import load_tokenizer, resolve_model
from dynamo_pd.protocol import SamplingParams, StopConditions

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def chat_ids(hf):
    """The chats as transformers renders them with the directory's chat template."""
    render = hf[1].apply_chat_template
    return [render(chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
            for chat in CHATS]


@pytest.fixture(scope="module")
def hf_answers(hf, chat_ids):
    """transformers' greedy answers, ended by the directory's generation config (eos) or MAX_TOKENS."""
    model = hf[0]
    answers = []
    for ids in chat_ids:
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=MAX_TOKENS, do_sample=False)
        answers.append(out[0, len(ids):].tolist())
    return answers


@pytest.mark.slow
def test_the_directory_is_what_save_pretrained_writes(model_dir, hf, tmp_path):
    from safetensors import safe_open

    model, tokenizer = hf
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    assert sorted(p.name for p in model_dir.iterdir()) == sorted(p.name for p in tmp_path.iterdir())
    ours, theirs = (json.loads((d / "config.json").read_text()) for d in (model_dir, tmp_path))
    assert ours["architectures"] == ["LlamaForCausalLM"] and ours["model_type"] == "llama"
    # the one key save_pretrained (transformers >= 4.56) does not write: the dtype under its older name
    assert ours.pop("torch_dtype") == ours["dtype"] == "float32"
    assert ours == theirs
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (model_dir / name).read_text() == (tmp_path / name).read_text(), name
    weights = []
    for d in (model_dir, tmp_path):
        with safe_open(str(d / "model.safetensors"), framework="pt") as f:
            weights.append((f.metadata(), {k: f.get_slice(k).get_shape() for k in f.keys()}))
    assert weights[0] == weights[1]


@pytest.mark.slow
def test_load_tokenizer_gives_what_autotokenizer_gives(model_dir, hf):
    """The workers' tokenizer (load_tokenizer skips importing AutoTokenizer) is AutoTokenizer's, for the same text
    in and out; AutoTokenizer takes a Llama directory's TokenizersBackend as named unless transformers lists llama
    among the model types whose named class it overrides."""
    from transformers.models.auto.tokenization_auto import MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS

    auto, ours = hf[1], load_tokenizer(model_dir)
    assert "llama" not in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
    assert type(ours) is type(auto) and ours.get_vocab() == auto.get_vocab()
    text = "Le café, 東京は日本の 🍕🍕 <|im_end|> and\n\n  spaces"
    ids = auto.encode(text)
    assert ours.encode(text) == ids
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip)


@pytest.mark.slow
def test_transformers_answers_chats_from_the_directory_as_the_native_engine_does(
        model_dir, hf, chat_ids, hf_answers):
    llm = LLM(model=str(model_dir), num_kv_blocks=32)
    results = llm.generate(chat_ids, SamplingParams(temperature=0), StopConditions(max_tokens=MAX_TOKENS))
    assert [r.token_ids for r in results] == hf_answers
    assert [r.text for r in results] == [hf[1].decode(a, skip_special_tokens=True) for a in hf_answers]
    assert "Paris" in results[0].text  # the template made a prompt the model answers


TINY_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tiny_llama_gguf(path: Path) -> Path:
    """A real GGUF of a tiny random Llama (byte-level BPE vocabulary, float32 tensors, chat template):
    converted in a second, where the default model's GGUF takes half a minute."""
    import gguf
    import numpy as np
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    hidden, ffn, heads, kv_heads, layers = 32, 64, 2, 1, 2
    tokens = [*bytes_to_unicode().values(), "he", "<|im_start|>", "<|im_end|>"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * (len(tokens) - 2) + [gguf.TokenType.CONTROL] * 2)
    writer.add_token_merges(["h e"])
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_chat_template(TINY_TEMPLATE)
    rng = np.random.default_rng(0)

    def weight(name: str, *shape: int) -> None:
        writer.add_tensor(name, (0.2 * rng.standard_normal(shape)).astype(np.float32))

    weight("token_embd.weight", len(tokens), hidden)  # tied: no output.weight
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    kv = hidden // heads * kv_heads
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        for name, shape in (("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden)),
                            ("attn_output", (hidden, hidden)), ("ffn_gate", (ffn, hidden)),
                            ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))):
            weight(f"blk.{i}.{name}.weight", *shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_converts_once_and_a_conversion_an_older_version_wrote_again(tmp_path, monkeypatch):
    """Versions before wrote config.json without architectures or torch_dtype: such a cached directory is
    converted again, not served; a complete one is served as it is."""
    monkeypatch.setenv("DYNAMO_PD_CACHE", str(tmp_path / "cache"))
    model = str(_tiny_llama_gguf(tmp_path / "tiny.gguf"))
    converted = resolve_model(model)
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["torch_dtype"] == config["dtype"] == "float32"
    assert (converted / "chat_template.jinja").read_text() == TINY_TEMPLATE
    assert {"generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= {
        p.name for p in converted.iterdir()}

    (converted / "marker").touch()
    assert resolve_model(model) == converted
    assert (converted / "marker").exists()  # served, not converted again

    old = {k: v for k, v in config.items() if k not in ("architectures", "torch_dtype")}
    (converted / "config.json").write_text(json.dumps(old, indent=2, sort_keys=True))
    assert resolve_model(model) == converted
    assert not (converted / "marker").exists()
    assert json.loads((converted / "config.json").read_text()) == config
