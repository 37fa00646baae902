"""A protocol.Guided as the grammar xgrammar compiles: one conversion, used by the frontend (which checks a
spec, without a vocabulary, before any worker sees it) and by the engines that enforce it in their own
sampler (engines/native/grammar.py: native, mocker).

JSON comes out compact with one space after `,` and `:` (xgrammar's any_whitespace=False): a small model
allowed free whitespace can fill max_tokens with newlines. Properties not in the schema are never generated
(xgrammar's strict mode): the output is valid against the schema either way. xgrammar is imported on first
use: it loads torch, which the frontend otherwise never imports.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any, get_args

from dynamo_pd.protocol import Guided, GuidedKind, InvalidRequestError

if TYPE_CHECKING:
    import xgrammar

KINDS = frozenset(get_args(GuidedKind))  # what an engine enforcing every kind declares (Engine.guided_kinds)
MAX_SPEC_CHARS = 64 * 1024  # compiling against a vocabulary costs with the grammar's size: bounded
JSON_OBJECT = '{"type": "object"}'  # response_format json_object: any JSON object

# Schema keywords xgrammar's JSON schema converter ignores (0.2.8, read from the grammars it prints): a schema
# using one would be followed only in part, so it is refused instead. `format` is an annotation unless a
# validator asks for it; xgrammar also drops minLength / maxLength beside a pattern or a format.
_IGNORED = ("uniqueItems", "contains", "minContains", "maxContains", "not", "if", "then", "else",
            "dependentRequired", "dependentSchemas", "dependencies")
_SUBSCHEMA = ("items", "additionalItems", "additionalProperties", "propertyNames", "unevaluatedProperties",
              "unevaluatedItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def grammar(guided: Guided) -> xgrammar.Grammar:
    """The grammar of `guided`; InvalidRequestError naming guided.param for a spec that does not compile or
    that xgrammar would follow only in part."""
    if len(guided.spec) > MAX_SPEC_CHARS:
        raise InvalidRequestError(f"{guided.param}: the {guided.kind} spec is over {MAX_SPEC_CHARS} "
                                  "characters", guided.param)
    try:
        return _grammar(guided)
    except InvalidRequestError:
        raise
    except Exception as exc:  # noqa: BLE001 - xgrammar's errors (RuntimeError, ValueError, its own), JSON's
        raise InvalidRequestError(f"{guided.param}: invalid {guided.kind}: {_reason(exc)}",
                                  guided.param) from None


def _grammar(guided: Guided) -> xgrammar.Grammar:
    import xgrammar as xgr

    kind, spec = guided.kind, guided.spec
    if kind == "json_schema":
        where = _ignored_keyword(json.loads(spec))
        if where is not None:
            raise InvalidRequestError(f"{guided.param}: the schema uses {where}, which structured output "
                                      "cannot enforce", guided.param)
        return xgr.Grammar.from_json_schema(spec, any_whitespace=False)
    if kind == "json_object":
        return xgr.Grammar.from_json_schema(JSON_OBJECT, any_whitespace=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(spec)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(spec)))
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(spec)
    tag = json.loads(spec)
    if isinstance(tag, dict) and "structures" in tag:  # vLLM's first form: begin / schema / end, and triggers
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema") or {}),
                                       end=s["end"]) for s in tag["structures"]]
        return xgr.Grammar.from_structural_tag(items, tag["triggers"])
    return xgr.Grammar.from_structural_tag(spec)


def choice_ebnf(choices: list[str]) -> str:
    """A grammar whose sentences are exactly `choices` (vLLM's choice_as_grammar, in xgrammar's EBNF)."""
    escapes = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}

    def literal(text: str) -> str:
        return '"' + "".join(escapes.get(c, f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c)
                             for c in text) + '"'

    return "root ::= " + " | ".join(literal(c) for c in choices)


def _ignored_keyword(schema: Any, path: str = "#") -> str | None:
    """The first place in `schema` that uses a keyword xgrammar ignores, as a JSON pointer; None if none."""
    if not isinstance(schema, dict):
        return None
    for key in _IGNORED:
        if key in schema:
            return f"{path}/{key}"
    if ("pattern" in schema or "format" in schema) and ("minLength" in schema or "maxLength" in schema):
        return f"{path}/{'minLength' if 'minLength' in schema else 'maxLength'} (beside pattern or format)"
    if len(schema.get("allOf") or ()) > 1:
        return f"{path}/allOf"
    subschemas = [(f"{path}/{key}", schema[key]) for key in _SUBSCHEMA if isinstance(schema.get(key), dict)]
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            subschemas += [(f"{path}/{key}/{i}", sub) for i, sub in enumerate(schema[key])]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            subschemas += [(f"{path}/{key}/{name}", sub) for name, sub in schema[key].items()]
    for where, sub in subschemas:
        found = _ignored_keyword(sub, where)
        if found is not None:
            return found
    return None


def _reason(exc: Exception) -> str:
    """xgrammar's message without the C++ source location it starts with."""
    text = str(exc).strip()
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text).split("\n")[0] or type(exc).__name__
