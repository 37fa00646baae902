"""Our tool-call parsers over the fixtures (tests/frontend/tool_fixtures): the whole output, and the output
streamed token by token, in one piece and (text formats) character by character, give each case's expected
content and calls; the streamed deltas are OpenAI's (one id and name per call, then argument pieces)."""

from __future__ import annotations

import pytest

from dynamo_pd.frontend.tools import ToolStream, make_parser
from tests.frontend.tool_cases import FAMILIES, PARSER, Codec, answer, expected, joined, load

CASES = [(family, case["name"]) for family in FAMILIES for case in load(family)["cases"]]


@pytest.fixture(scope="module")
def codecs(model_dir):
    return {family: Codec(family, model_dir) for family in FAMILIES}


def _case(family: str, name: str) -> tuple[dict, dict]:
    data = load(family)
    return data, next(c for c in data["cases"] if c["name"] == name)


def stream(family: str, tools: list, codec: Codec, pieces: list[tuple[str, list[int]]]) -> dict:
    parser = ToolStream(make_parser(PARSER.get(family, family), tools, codec.vocab))
    deltas = [parser.feed(text, ids) for text, ids in pieces] + [parser.feed("", (), final=True)]
    return joined([(d.content, d.reasoning, [(c.index, c.id, c.name, c.arguments) for c in d.calls])
                   for d in deltas])


def test_every_family_has_ten_fixtures_with_malformed_and_cut_ones():
    for family in FAMILIES:
        names = [c["name"] for c in load(family)["cases"]]
        assert len(names) >= 10, family
        assert any("malformed" in n for n in names) or family == "harmony", family
        assert any("cut" in n for n in names), family


@pytest.mark.parametrize("family, name", CASES)
def test_the_whole_output_parses_as_expected(codecs, family, name):
    data, case = _case(family, name)
    codec = codecs[family]
    parsed = make_parser(PARSER.get(family, family), data["tools"], codec.vocab).extract(case["text"],
                                                                                         codec.encode(case["text"]))
    assert answer(parsed.content, [(c.name, c.arguments) for c in parsed.calls], parsed.reasoning) == \
        expected(case, "whole")


@pytest.mark.parametrize("family, name", CASES)
def test_the_streamed_deltas_join_to_the_expected_answer(codecs, family, name):
    data, case = _case(family, name)
    codec = codecs[family]
    want = expected(case, "stream")
    assert stream(family, data["tools"], codec, codec.pieces(case["text"])) == want
    assert stream(family, data["tools"], codec, [(case["text"], codec.encode(case["text"]))]) == want
    if family != "harmony":  # harmony reads token ids, which characters do not split
        assert stream(family, data["tools"], codec, [(ch, []) for ch in case["text"]]) == want


def test_a_call_streams_its_name_first_then_its_arguments_in_pieces(codecs):
    data, case = _case("hermes", "one call")
    codec = codecs["hermes"]
    parser = ToolStream(make_parser("hermes", data["tools"], codec.vocab))
    calls = [c for text, ids in codec.pieces(case["text"]) for c in parser.feed(text, ids).calls]
    assert calls[0].id.startswith("call_") and calls[0].name == "get_weather" and calls[0].index == 0
    assert len(calls) > 3 and all(c.id is None and c.name is None and c.arguments for c in calls[1:])
