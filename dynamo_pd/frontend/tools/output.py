"""One chat request's output read into content, reasoning and tool calls, whole or as it streams.

`tool_choice`: "auto" (the default with tools) reads calls in the model's family format; "none" reads none
(and the tools are not rendered, as vLLM's `--exclude-tools-when-tool-choice-none`); "required" and a named
function constrain the output to JSON (`choice_schema`, the form vLLM's serving uses: a list of
{"name", "parameters"} for "required", the function's arguments for a named one) and read it as such.
`parallel_tool_calls: false` keeps the first call.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import Any

from dynamo_pd.frontend.tools import TOOL_PARSERS, detect, make_parser
from dynamo_pd.frontend.tools.base import (Delta, DeltaCall, Parsed, PartialCall, Scan, ToolCall, ToolParser,
                                           ToolStream, json_value_end, loads)
from dynamo_pd.frontend.tools.hermes import json_call
from dynamo_pd.frontend.tools.reasoning import ThinkSplitter, prompt_opens_reasoning


def choice_schema(tools: list[dict[str, Any]], choice: Any, parallel: bool) -> dict[str, Any] | None:
    """The JSON schema a "required" or named tool_choice constrains the output to; None for the others."""
    if isinstance(choice, dict):
        function = next(t["function"] for t in tools if t["function"]["name"] == choice["function"]["name"])
        return function.get("parameters") or {"type": "object", "properties": {}}
    if choice != "required":
        return None
    one_of = [{"type": "object", "required": ["name", "parameters"],
               "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                              "parameters": t["function"].get("parameters") or {"type": "object"}}}
              for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class ForcedParser(ToolParser):
    """The output of a constrained tool_choice: a JSON list of {"name", "parameters"}, or one named call's
    arguments."""

    name = "forced"

    def __init__(self, tools: Sequence[dict[str, Any]], named: str | None) -> None:
        super().__init__(tools)
        self.named = named

    def extract(self, text: str, token_ids: Sequence[int] = ()) -> Parsed:
        scan = self.scan(text, token_ids, final=True)
        calls = [ToolCall(c.name, c.arguments) for c in scan.calls if c.name is not None]
        if not calls or not all(_is_object(c.arguments) for c in calls):
            return Parsed(text or None, [])  # cut short (max_tokens): what there is, as content
        return Parsed(None, calls)

    def scan(self, text: str, token_ids: Sequence[int], final: bool) -> Scan:
        if self.named is not None:
            end = json_value_end(text, 0) if text.strip() else None
            return Scan("", [PartialCall(self.named, text[:end] if end is not None else text.rstrip())])
        calls, i = [], text.find("[") + 1
        if i == 0:
            return Scan("")
        while True:
            while i < len(text) and text[i] in ", \t\r\n":
                i += 1
            if i >= len(text) or text[i] != "{":
                return Scan("", calls)
            calls.append(json_call(text[i:], args_keys=("parameters",)))
            end = json_value_end(text, i)
            if end is None:
                return Scan("", calls)
            i = end


def _is_object(arguments: str) -> bool:
    return isinstance(loads(arguments), dict)


@dataclass(frozen=True)
class Reading:
    """How a request's output is read: its tool parser (None: no calls), whether `<think>` is split off."""

    parser: ToolParser | None
    think: bool = False
    in_reasoning: bool = False  # the prompt ends inside <think>
    parallel: bool = True


def reading(family: str | None, reasoning: str | None, tools: list[dict[str, Any]] | None, choice: Any,
            parallel: bool | None, vocab: Container[str], prompt_opens_reasoning: bool) -> Reading | None:
    """The reading of one request, or None when its output is plain content."""
    parser: ToolParser | None = None
    if tools and choice != "none":
        if choice == "required" or isinstance(choice, dict):
            parser = ForcedParser(tools, choice["function"]["name"] if isinstance(choice, dict) else None)
        else:
            parser = make_parser(family or "hermes", tools, vocab)
    if parser is None and reasoning is None:
        return None
    return Reading(parser, reasoning is not None, prompt_opens_reasoning, parallel is not False)


class OutputReader:
    """Reads one request's output: `feed` each engine output's text and token ids, `finish` at the end; or
    `whole` for all of it at once. Special tokens a family writes its calls in (which engines leave out of the
    text) are put back from the token ids."""

    def __init__(self, reading: Reading, decode: Callable[..., str], marker_ids: dict[int, str]) -> None:
        self._reading, self._decode, self._markers = reading, decode, marker_ids
        self._think = ThinkSplitter(reading.in_reasoning) if reading.think else None
        self._tools = ToolStream(reading.parser) if reading.parser is not None else None

    @property
    def called(self) -> bool:
        return self._tools is not None and self._tools.called

    def text(self, text: str, token_ids: Sequence[int]) -> str:
        if not self._markers or not any(t in self._markers for t in token_ids):
            return text
        parts, run = [], []
        for token in token_ids:
            if token in self._markers:
                parts += [self._decode(run, skip_special_tokens=True) if run else "", self._markers[token]]
                run = []
            else:
                run.append(token)
        return "".join(parts) + (self._decode(run, skip_special_tokens=True) if run else "")

    def feed(self, text: str, token_ids: Sequence[int], final: bool = False) -> Delta:
        text = self.text(text, token_ids)
        reasoning = ""
        if self._think is not None:
            reasoning, text = self._think.feed(text, final)
        if self._tools is None:
            return Delta(content=text, reasoning=reasoning)
        delta = self._tools.feed(text, token_ids, final)
        delta.reasoning = reasoning + delta.reasoning
        if not self._reading.parallel:
            delta.calls = [c for c in delta.calls if c.index == 0]
        return delta

    def whole(self, text: str, token_ids: Sequence[int]) -> Parsed:
        text = self.text(text, token_ids)
        reasoning = None
        if self._think is not None:
            self._think.feed(text, final=True)
            reasoning, text = self._think.split()
        if self._reading.parser is None:
            return Parsed(text or None, [], reasoning or None)
        parsed = self._reading.parser.extract(text, token_ids)
        calls = [ToolCall(c.name, c.arguments, self._reading.parser.new_id()) for c in parsed.calls]
        if not self._reading.parallel:
            calls = calls[:1]
        return Parsed(parsed.content, calls, reasoning or parsed.reasoning)


def delta_calls(calls: list[DeltaCall]) -> list[dict[str, Any]]:
    """OpenAI's `delta.tool_calls`."""
    out = []
    for call in calls:
        item: dict[str, Any] = {"index": call.index}
        if call.id is not None:
            item |= {"id": call.id, "type": "function",
                     "function": {"name": call.name, "arguments": call.arguments}}
        else:
            item["function"] = {"arguments": call.arguments}
        out.append(item)
    return out


def message_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """OpenAI's `message.tool_calls`."""
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


class Readers:
    """Makes each chat request's OutputReader; what it reads off a model's tokenizer (its family, vocabulary,
    marker token ids) is read once per tokenizer."""

    def __init__(self, tool_call_parser: str | None, reasoning_parser: str | None) -> None:
        self._family, self._reasoning = tool_call_parser, reasoning_parser
        self._models: dict[int, tuple[Any, str, frozenset[str], dict[int, str]]] = {}

    def _model(self, tokenizer: Any) -> tuple[str, frozenset[str], dict[int, str]]:
        known = self._models.get(id(tokenizer))
        if known is None or known[0] is not tokenizer:
            vocab = tokenizer.get_vocab()
            family = self._family or detect(getattr(tokenizer, "model_type", ""), vocab,
                                            getattr(tokenizer, "chat_template", None))
            markers = {vocab[m]: m for m in TOOL_PARSERS[family].markers if m in vocab}
            known = self._models[id(tokenizer)] = (tokenizer, family, frozenset(vocab), markers)
        return known[1], known[2], known[3]

    def reader(self, tokenizer: Any, tools: list[dict[str, Any]], choice: Any, parallel: bool | None,
               prompt_ids: list[int]) -> OutputReader | None:
        if not (tools and choice != "none") and self._reasoning is None:
            return None
        family, vocab, markers = self._model(tokenizer)
        opens = self._reasoning is not None and prompt_opens_reasoning(tokenizer.decode(prompt_ids[-8:]))
        read = reading(family, self._reasoning, tools, choice, parallel, vocab, opens)
        return None if read is None else OutputReader(read, tokenizer.decode, markers)
