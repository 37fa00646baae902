"""Qwen3-Coder XML:
`<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>`. Each value
loses one wrapping newline and is typed by the tool's JSON schema (as vLLM's `qwen3_coder` does: an integer
parameter's "5" is 5, an object's is parsed JSON, a string stays text). A call's arguments are sent when its
`</function>` comes (or the output ends, with the parameters that closed)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from dynamo_pd.frontend.tools.base import (INVALID, Parsed, PartialCall, Scan, ToolCall, ToolParser, dumps,
                                           held_back, loads)

START, FUNCTION, FUNCTION_END = "<tool_call>", "<function=", "</function>"
_PARAM = re.compile(r"<\s*parameter\s*=\s*([^>]*)>(.*?)(?:<\s*/\s*parameter\s*>|(?=<\s*parameter\s*=))",
                    re.DOTALL)


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"

    def extract(self, text: str, token_ids: Sequence[int] = ()) -> Parsed:
        scan = self.scan(text, token_ids, final=True)
        calls = [ToolCall(c.name, c.arguments) for c in scan.calls if c.name]
        return Parsed(scan.content or None, calls)

    def scan(self, text: str, token_ids: Sequence[int], final: bool) -> Scan:
        starts = [i for i in (text.find(START), text.find(FUNCTION)) if i >= 0]
        if not starts:
            if final:
                return Scan(text)
            settled = text[:len(text) - max(held_back(text, START), held_back(text, FUNCTION))]
            return Scan(settled.rstrip())  # the whitespace before a call is dropped: it waits
        calls = []
        for piece in text[min(starts):].split(FUNCTION)[1:]:
            name_end = piece.find(">")
            if name_end < 0:
                if final and piece.strip():
                    calls.append(PartialCall(piece.split("\n")[0].strip(), "{}"))
                break
            name, body = piece[:name_end].strip(), piece[name_end + 1:]
            end = body.find(FUNCTION_END)
            done = end >= 0 or final
            arguments = self._arguments(name, body[:end] if end >= 0 else body) if done else ""
            calls.append(PartialCall(name, arguments))
            if end < 0:
                break
        return Scan(text[:min(starts)].rstrip(), calls)

    def _arguments(self, name: str, body: str) -> str:
        properties = self.properties(name)
        values = {key.strip(): _typed(_unwrap(value), properties.get(key.strip()))
                  for key, value in _PARAM.findall(body)}
        return dumps(values)


def _unwrap(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


_ENUM_TYPES = {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string",
               list: "array"}


def _types(schema: Any) -> set[str]:
    if not isinstance(schema, dict):
        return {"string"}
    kinds = schema.get("type")
    types = {kinds} if isinstance(kinds, str) else set(kinds) if isinstance(kinds, list) else set()
    for value in schema.get("enum") or []:
        types.add(_ENUM_TYPES.get(type(value), "object"))
    for choice in ("anyOf", "oneOf", "allOf"):
        for option in schema.get(choice) or []:
            types |= _types(option)
    return types or {"string"}


def _typed(value: str, schema: Any) -> Any:
    """`value` as the first of the schema's types it reads as (null, integer, number, boolean, object/array,
    then string); no schema: a string."""
    if schema is None:
        return value
    types = _types(schema)
    if "null" in types and value.lower() == "null":
        return None
    if "string" in types and not types & {"integer", "number", "boolean", "object", "array"}:
        return value
    if "integer" in types:
        try:
            return int(value)
        except ValueError:
            pass
    if "number" in types:
        try:
            number = float(value)
            if math.isfinite(number):
                return int(number) if number == int(number) else number
        except ValueError:
            pass
    if "boolean" in types and value.strip().lower() in ("true", "1", "false", "0"):
        return value.strip().lower() in ("true", "1")
    if types & {"object", "array"}:
        parsed = loads(value)
        if parsed is not INVALID:
            return parsed
    return value
