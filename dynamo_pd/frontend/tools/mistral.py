"""Mistral `[TOOL_CALLS]`. Tokenizers with `[ARGS]` (v11 on): `[TOOL_CALLS]name[ARGS]{...}` per call (or
`name{...}`), the arguments the first JSON value after the name, kept as written; before v11: `[TOOL_CALLS]`
then a JSON array of {"name", "arguments"} (or one such object). As vLLM's `mistral` parser, which picks the
same way from the vocabulary."""

from __future__ import annotations

import json
import re
from collections.abc import Container, Sequence
from typing import Any

from dynamo_pd.frontend.tools.base import (INVALID, Parsed, PartialCall, Scan, ToolCall, ToolParser, dumps,
                                           held_back, json_value_end, loads, mistral_call_id)
from dynamo_pd.frontend.tools.hermes import json_call

CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ARRAY = re.compile(r"\[{.*}\]", re.DOTALL)


class MistralParser(ToolParser):
    name = "mistral"
    markers = (CALLS, ARGS)

    def __init__(self, tools: Sequence[dict[str, Any]] = (), vocab: Container[str] = frozenset()) -> None:
        super().__init__(tools, vocab)
        self.v11 = ARGS in vocab

    def new_id(self) -> str:
        return mistral_call_id()

    def extract(self, text: str, token_ids: Sequence[int] = ()) -> Parsed:
        if CALLS not in text:
            return Parsed(text, [])
        return self._extract_v11(text) if self.v11 else self._extract_array(text)

    def _extract_v11(self, text: str) -> Parsed:
        content, *segments = text.split(CALLS)
        calls = []
        for segment in segments:
            name, arguments = _name_and_arguments(segment, final=True)
            if name:
                calls.append(ToolCall(name, _first_value(arguments) or "{}"))
        return Parsed(content.rstrip() or None, calls)

    def _extract_array(self, text: str) -> Parsed:
        content, *segments = text.split(CALLS)
        body = next((s.strip() for s in segments if s.strip()), "")  # repeated markers count as one
        try:
            parsed, _ = json.JSONDecoder().raw_decode(body)
        except ValueError:
            found = _ARRAY.findall(body)
            parsed = loads(found[0]) if found else INVALID
        items = [parsed] if isinstance(parsed, dict) else parsed if isinstance(parsed, list) else []
        calls = []
        for item in items:
            if not isinstance(item, dict) or not ("name" in item or "arguments" in item):
                continue
            arguments = item.get("arguments")
            if not isinstance(arguments, str):
                arguments = "{}" if arguments is None else dumps(arguments)
            calls.append(ToolCall(item["name"] if isinstance(item.get("name"), str) else "", arguments))
        if not calls:
            return Parsed(body, [])
        return Parsed(content if content.strip() else None, calls)

    def scan(self, text: str, token_ids: Sequence[int], final: bool) -> Scan:
        first = text.find(CALLS)
        if first < 0:
            if final:
                return Scan(text)
            settled = text[:len(text) - held_back(text, CALLS)]
            # v11 drops the whitespace before a call: it waits until what follows it is known
            return Scan(settled.rstrip() if self.v11 else settled)
        content = text[:first].rstrip() if self.v11 else text[:first]
        if not self.v11:
            return Scan(content, _array_calls(text[first + len(CALLS):]))
        calls = []
        for segment in text[first + len(CALLS):].split(CALLS):
            name, arguments = _name_and_arguments(segment, final)
            if name is None:
                break
            end = json_value_end(arguments, 0) if arguments.strip() else None
            calls.append(PartialCall(name, arguments[:end] if end is not None else arguments.rstrip()))
        if final and calls and not calls[-1].arguments:
            calls[-1].arguments = "{}"
        return Scan(content, calls)


def _name_and_arguments(segment: str, final: bool) -> tuple[str | None, str]:
    """A v11 call's name (None until its end is seen) and the text of its arguments."""
    if ARGS in segment:
        name, arguments = segment.split(ARGS, 1)
        return name.strip(), arguments.lstrip()
    brace = segment.find("{")
    if brace >= 0:
        return segment[:brace].strip(), segment[brace:]
    return (segment.strip(), "") if final else (None, "")


def _first_value(arguments: str) -> str:
    stripped = arguments.strip()
    try:
        _, end = json.JSONDecoder().raw_decode(stripped)
    except ValueError:
        return stripped  # kept as written, as vLLM does: the client sees what the model wrote
    return stripped[:end]


def _array_calls(body: str) -> list[PartialCall]:
    """Pre-v11: the calls of a JSON array (or one object) as far as it goes."""
    i = len(body) - len(body.lstrip())
    if i < len(body) and body[i] == "{":
        return [json_call(body[i:])]
    if i >= len(body) or body[i] != "[":
        return []
    calls, i = [], i + 1
    while True:
        while i < len(body) and body[i] in ", \t\r\n":
            i += 1
        if i >= len(body) or body[i] != "{":
            return calls
        calls.append(json_call(body[i:]))
        end = json_value_end(body, i)
        if end is None:
            return calls
        i = end
