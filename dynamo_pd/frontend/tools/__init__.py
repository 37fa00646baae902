"""Tool calls and reasoning in model output: one parser per format family, chosen per model.

    parser = make_parser("hermes", tools, vocab)       # one per request
    parsed = parser.extract(text, token_ids)           # the whole output: content, calls
    stream = ToolStream(parser); stream.feed(text, token_ids); stream.feed("", final=True)  # OpenAI deltas

`--tool-call-parser NAME` picks the family for every model; without it each model's own files do (`detect`).
The families and the vLLM `--tool-call-parser` each matches: hermes (hermes), llama3_json (llama3_json),
mistral (mistral), qwen3_coder (qwen3_coder), pythonic (pythonic), deepseek_v3 (deepseek_v3), harmony (openai,
gpt-oss). `--reasoning-parser think` splits `<think>...</think>` into `reasoning_content`.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Any

from dynamo_pd.frontend.tools.base import Delta, DeltaCall, Parsed, ToolCall, ToolParser, ToolStream
from dynamo_pd.frontend.tools.deepseek_v3 import DeepSeekV3Parser
from dynamo_pd.frontend.tools.harmony import HarmonyParser
from dynamo_pd.frontend.tools.hermes import HermesParser
from dynamo_pd.frontend.tools.llama3 import Llama3JsonParser
from dynamo_pd.frontend.tools.mistral import MistralParser
from dynamo_pd.frontend.tools.pythonic import PythonicParser
from dynamo_pd.frontend.tools.qwen3_coder import Qwen3CoderParser

__all__ = ["Delta", "DeltaCall", "Parsed", "ToolCall", "ToolParser", "ToolStream", "TOOL_PARSERS",
           "REASONING_PARSERS", "detect", "make_parser"]

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesParser, Llama3JsonParser, MistralParser, Qwen3CoderParser, PythonicParser,
                              DeepSeekV3Parser, HarmonyParser)
}
REASONING_PARSERS = ("think",)


def make_parser(name: str, tools: Sequence[dict[str, Any]],
                vocab: Container[str] = frozenset()) -> ToolParser:
    return TOOL_PARSERS[name](tools, vocab)


def detect(model_type: str, vocab: Container[str], template: str | None) -> str:
    """The family a model writes calls in, read from its config's model_type, its vocabulary's markers and its
    chat template; hermes otherwise (the format of the fallback prompt for templates without tools)."""
    if model_type == "gpt_oss":
        return "harmony"
    for family in ("mistral", "llama3_json", "deepseek_v3"):
        if TOOL_PARSERS[family].markers[0] in vocab:
            return family
    if template is not None and "<function=" in template:
        return "qwen3_coder"
    return "hermes"
