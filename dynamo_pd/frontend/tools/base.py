"""What every tool-call parser shares: the parsed shapes, the streaming differ, JSON scanning.

A family parser turns the model's whole output into content and calls (`extract`, the non-streaming answer)
and, while it streams, reports what is settled so far (`scan`): the content no later text can turn into a
call, and each call's name once whole and its arguments text as far as it goes. `ToolStream` diffs successive
scans into OpenAI's delta format, so a family never tracks what it has sent.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's `function.arguments`
    id: str = ""


@dataclass(frozen=True)
class Parsed:
    """A whole output: content (None when there is none), its calls, and reasoning where the format has it."""

    content: str | None
    calls: list[ToolCall]
    reasoning: str | None = None


@dataclass
class PartialCall:
    name: str | None  # None until the whole name is known
    arguments: str = ""  # the arguments text so far: each scan's extends the last's


@dataclass
class Scan:
    content: str  # settled content so far: each scan's extends the last's (so does reasoning's)
    calls: list[PartialCall] = field(default_factory=list)
    reasoning: str = ""


@dataclass(frozen=True)
class DeltaCall:
    """One `delta.tool_calls[i]`: the first for an index carries id and name."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    calls: list[DeltaCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls)


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def mistral_call_id() -> str:
    # Mistral's templates refuse any id but 9 alphanumerics (as mistral-common validates them)
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


class ToolParser:
    """A family's parser, one per request (streaming keeps state). `markers`: special tokens its format is
    written in, which the frontend keeps in the text it parses (engines detokenize without special tokens)."""

    name = ""
    markers: tuple[str, ...] = ()

    def __init__(self, tools: Sequence[dict[str, Any]] = (), vocab: Container[str] = frozenset()) -> None:
        self.tools = list(tools)  # the request's, as OpenAI's {"type": "function", "function": {...}}

    def new_id(self) -> str:
        return call_id()

    def extract(self, text: str, token_ids: Sequence[int] = ()) -> Parsed:
        raise NotImplementedError

    def scan(self, text: str, token_ids: Sequence[int], final: bool) -> Scan:
        """What `text` (the output so far; each call's extends the last's) settles; `final`: it ended."""
        raise NotImplementedError

    def properties(self, name: str) -> dict[str, Any]:
        """The JSON schema properties of tool `name`'s parameters ({} for an unknown tool)."""
        for tool in self.tools:
            function = tool.get("function") or {}
            if function.get("name") == name:
                return (function.get("parameters") or {}).get("properties") or {}
        return {}


class ToolStream:
    """Feeds a parser the output as it streams; returns each step's delta in OpenAI's format."""

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._text, self._ids = "", []
        self._content = self._reasoning = 0  # characters of each sent
        self._sent: list[tuple[str, int]] = []  # per call: its id, characters of arguments sent

    @property
    def called(self) -> bool:
        return bool(self._sent)

    def feed(self, text: str, token_ids: Sequence[int] = (), final: bool = False) -> Delta:
        self._text += text
        self._ids.extend(token_ids)
        scan = self._parser.scan(self._text, self._ids, final)
        delta = Delta(content=scan.content[self._content:], reasoning=scan.reasoning[self._reasoning:])
        self._content = max(self._content, len(scan.content))
        self._reasoning = max(self._reasoning, len(scan.reasoning))
        for index, call in enumerate(scan.calls):
            if index == len(self._sent):
                if call.name is None:
                    break
                self._sent.append((self._parser.new_id(), 0))
                delta.calls.append(DeltaCall(index, self._sent[index][0], call.name))
            id_, sent = self._sent[index]
            if len(call.arguments) > sent:
                piece = call.arguments[sent:]
                self._sent[index] = (id_, len(call.arguments))
                if delta.calls and delta.calls[-1].index == index and not delta.calls[-1].arguments:
                    first = delta.calls.pop()
                    delta.calls.append(DeltaCall(index, first.id, first.name, piece))
                else:
                    delta.calls.append(DeltaCall(index, arguments=piece))
        return delta


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag` (kept back from content until settled)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def json_value_end(text: str, start: int) -> int | None:
    """The end of the JSON value (object, array, string or scalar) at `start` (after whitespace), or None
    when the text ends first. Brackets and strings only: a malformed value ends where its brackets close."""
    i, n = _skip_ws(text, start), len(text)
    if i == n:
        return None
    if text[i] not in "{[\"":
        while i < n and text[i] not in ",}] \t\r\n":
            i += 1
        return i if i < n else None
    depth, in_string, escaped = 0, False, False
    for j in range(i, n):
        c = text[j]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if depth == 0:
                    return j + 1
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


INVALID = object()


def loads(text: str) -> Any:
    """json.loads, or INVALID for text that is not one JSON value."""
    try:
        return json.loads(text)
    except ValueError:
        return INVALID


def object_members(text: str, start: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The members of the JSON object at `start` seen so far, each key's value as (start, end or None while it
    runs on), and the object's end (None while it is open or once it stops being an object)."""
    members: dict[str, tuple[int, int | None]] = {}
    i = _skip_ws(text, start)
    if i >= len(text) or text[i] != "{":
        return members, None
    i += 1
    while True:
        i = _skip_ws(text, i)
        if i < len(text) and text[i] == "}":
            return members, i + 1
        if i >= len(text) or text[i] != '"':
            return members, None
        key_end = json_value_end(text, i)
        if key_end is None:
            return members, None
        key = loads(text[i:key_end])
        i = _skip_ws(text, key_end)
        if i >= len(text) or text[i] != ":" or not isinstance(key, str):
            return members, None
        value_start = _skip_ws(text, i + 1)
        value_end = json_value_end(text, value_start)
        members[key] = (value_start, value_end)
        if value_end is None:
            return members, None
        i = _skip_ws(text, value_end)
        if i < len(text) and text[i] == ",":
            i += 1
        elif i >= len(text) or text[i] != "}":
            return members, None


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
