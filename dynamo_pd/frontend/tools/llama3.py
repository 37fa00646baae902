"""Llama 3.x JSON: the output is `{"name": ..., "parameters": {...}}` (or "arguments"), optionally after
`<|python_tag|>`, several joined by "; ". An output that starts otherwise is content, streamed or not (vLLM's
`llama3_json` finds JSON anywhere in a whole output but only at the start of a streamed one: we keep one
rule)."""

from __future__ import annotations

import json
from collections.abc import Sequence

from dynamo_pd.frontend.tools.base import Parsed, Scan, ToolCall, ToolParser, dumps, json_value_end
from dynamo_pd.frontend.tools.hermes import json_call

TAG = "<|python_tag|>"
_ARGS = ("parameters", "arguments")


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = (TAG,)

    def _body(self, text: str) -> int | None:
        if text.startswith(TAG):
            return len(TAG)
        return 0 if text.startswith("{") else None

    def extract(self, text: str, token_ids: Sequence[int] = ()) -> Parsed:
        start = self._body(text)
        if start is None:
            return Parsed(text, [])
        calls, decoder, i = [], json.JSONDecoder(), start
        while (i := text.find("{", i)) >= 0:  # each top-level object, whatever separates them
            try:
                body, end = decoder.raw_decode(text, i)
            except ValueError:
                return Parsed(text, [])
            key = next((k for k in _ARGS if k in body), None) if isinstance(body, dict) else None
            if key is None or not isinstance(body.get("name"), str):
                return Parsed(text, [])
            calls.append(ToolCall(body["name"], dumps(body[key])))
            i = end
        return Parsed(None, calls) if calls else Parsed(text, [])

    def scan(self, text: str, token_ids: Sequence[int], final: bool) -> Scan:
        start = self._body(text)
        if start is None:
            return Scan("" if TAG.startswith(text) and not final else text)
        calls, i = [], start
        while i < len(text):
            calls.append(json_call(text[i:], args_keys=_ARGS))
            end = json_value_end(text, i)
            if end is None:
                break
            i = end
            while i < len(text) and text[i] in "; \t\r\n":
                i += 1
        if final and not any(call.name for call in calls):
            return Scan(text)  # nothing was a call, so nothing was sent: the text is content
        return Scan("", calls)
