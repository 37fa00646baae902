"""Pythonic calls (Llama 3.2 / 4, ToolACE): the output is a Python list of calls with keyword arguments,
`[get_weather(city='Paris', days=3), search(query="rain")]`, values Python or JSON literals. A list is sent
when it parses whole (at the end of the output): until then it may still turn out to be text."""

from __future__ import annotations

import ast
import warnings
from collections.abc import Sequence
from typing import Any

from dynamo_pd.frontend.tools.base import Parsed, PartialCall, Scan, ToolCall, ToolParser, dumps

_NAMES = {"true": True, "false": False, "null": None}


class PythonicParser(ToolParser):
    name = "pythonic"

    def extract(self, text: str, token_ids: Sequence[int] = ()) -> Parsed:
        if not text.startswith("["):
            return Parsed(text, [])
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", SyntaxWarning)
                tree = ast.parse(text.strip())
            [statement] = tree.body
            if not isinstance(statement, ast.Expr) or not isinstance(statement.value, ast.List):
                raise ValueError("not a list")
            calls = [_call(node) for node in statement.value.elts]
        except (SyntaxError, ValueError):
            return Parsed(text, [])
        return Parsed(None, calls) if calls else Parsed(text, [])

    def scan(self, text: str, token_ids: Sequence[int], final: bool) -> Scan:
        if not text.startswith("["):
            return Scan(text)
        if not final:
            return Scan("")
        parsed = self.extract(text)
        return Scan(parsed.content or "", [PartialCall(c.name, c.arguments) for c in parsed.calls])


def _call(node: ast.expr) -> ToolCall:
    if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
        raise ValueError("a call with keyword arguments only")
    return ToolCall(_dotted(node.func), dumps({k.arg: _value(k.value) for k in node.keywords}))


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Name):
        return node.id
    raise ValueError("a call of a name")


def _value(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) for k in node.keys):
        return {k.value: _value(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [_value(v) for v in node.elts]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _value(node.operand)
        if isinstance(operand, (int, float)) and not isinstance(operand, bool):
            return -operand if isinstance(node.op, ast.USub) else operand
    raise ValueError("a literal argument")
