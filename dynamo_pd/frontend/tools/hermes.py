"""Hermes / Qwen 2.5 JSON in tags: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block a
call. Content is the text before the first block (text after the blocks is dropped, as vLLM's `hermes` parser
does)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from dynamo_pd.frontend.tools.base import (INVALID, Parsed, PartialCall, Scan, ToolCall, ToolParser, dumps,
                                           held_back, loads, object_members)

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


class HermesParser(ToolParser):
    name = "hermes"

    def extract(self, text: str, token_ids: Sequence[int] = ()) -> Parsed:
        if START not in text:
            return Parsed(text, [])
        calls = []
        for closed, open_ in _BLOCK.findall(text):
            body = loads(closed or open_)
            if not isinstance(body, dict) or not isinstance(body.get("name"), str) or "arguments" not in body:
                return Parsed(text, [])  # one block that is not a call: the whole text is content
            calls.append(ToolCall(body["name"], dumps(body["arguments"])))
        return Parsed(text[:text.index(START)] or None, calls)

    def scan(self, text: str, token_ids: Sequence[int], final: bool) -> Scan:
        first = text.find(START)
        if first < 0:
            return Scan(text if final else text[:len(text) - held_back(text, START)])
        calls, pos = [], first
        while (start := text.find(START, pos)) >= 0:
            body_start = start + len(START)
            end = text.find(END, body_start)
            body = text[body_start:] if end < 0 else text[body_start:end]
            if end < 0 and not final:
                body = body[:len(body) - held_back(body, END)]
            calls.append(json_call(body))
            if end < 0:
                break
            pos = end + len(END)
        return Scan(text[:first], calls)


def json_call(body: str, name_key: str = "name", args_keys: tuple[str, ...] = ("arguments",)) -> PartialCall:
    """A {"name": ..., "arguments": ...} object as far as it goes: the name once its string closes, the
    arguments' JSON text as written (to their end once it comes)."""
    members, _ = object_members(body, 0)
    name = None
    if name_key in members and members[name_key][1] is not None:
        start, end = members[name_key]
        value = loads(body[start:end])
        name = value if isinstance(value, str) and value is not INVALID else None
    arguments = ""
    key = next((k for k in args_keys if k in members), None)
    if key is not None:
        start, end = members[key]
        arguments = body[start:end] if end is not None else body[start:].rstrip()
    return PartialCall(name, arguments)
