"""Structured output at the frontend: the request fields that ask for it, read into one protocol.Guided that
is checked (compiled without a vocabulary, dynamo_pd.guided) before any worker sees the request.

The fields: OpenAI's `response_format` (`json_object`; `json_schema`, strict or not: the schema is enforced
either way; vLLM's `structural_tag`), vLLM's `structured_outputs` object (json, regex, choice, grammar,
json_object, structural_tag) and its older extra fields (`guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`, `structural_tag`, `guided_decoding_backend`). A request asks for one form at most; a second
is a 400 naming it, as is every spec that does not compile.
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dynamo_pd.guided import grammar
from dynamo_pd.protocol import Guided, InvalidRequestError

BACKENDS = (None, "auto", "xgrammar")  # guided_decoding_backend values served: the one grammar engine here


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str | None = None  # OpenAI's; names nothing here
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is enforced whether or not it is strict


class Structure(BaseModel):
    """vLLM's first structural tag form: text between `begin` and `end` follows `schema`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    begin: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    end: str


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None  # structural_tag, xgrammar's structural tag format
    structures: list[Structure] | None = None  # structural_tag, vLLM's first form, with triggers
    triggers: list[str] | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (its StructuredOutputsParams): one constraint."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False  # served either way: JSON comes out compact (dynamo_pd.guided)
    disable_additional_properties: bool = False  # served either way: no undeclared property is generated
    whitespace_pattern: str | None = None  # not served: a 400 names it


def json_schema(schema: dict[str, Any] | str, param: str) -> Guided:
    """A JSON schema (a dict, or its JSON text) as the Guided that makes the output valid against it; `param`
    is the request field an error names (a tool call's schema: "tools")."""
    if isinstance(schema, str):
        try:
            json.loads(schema)
        except ValueError as exc:
            raise InvalidRequestError(f"{param}: the schema is not JSON: {exc}", param) from None
        return Guided(kind="json_schema", spec=schema, param=param)
    return Guided(kind="json_schema", spec=json.dumps(schema), param=param)


def from_request(body: Any) -> Guided | None:
    """The one constraint a chat or completion request asks for (openai._Common's fields), or None."""
    if body.guided_decoding_backend not in BACKENDS:
        raise InvalidRequestError(f"guided_decoding_backend {body.guided_decoding_backend!r} is not served; "
                                  "this server's grammar engine is xgrammar", "guided_decoding_backend")
    asked: list[Guided] = []
    if body.response_format is not None and body.response_format.type != "text":
        asked.append(_response_format(body.response_format))
    if body.structured_outputs is not None:
        asked.append(_structured_outputs(body.structured_outputs))
    if body.guided_json is not None:
        asked.append(json_schema(body.guided_json, "guided_json"))
    if body.guided_regex is not None:
        asked.append(Guided(kind="regex", spec=body.guided_regex, param="guided_regex"))
    if body.guided_choice is not None:
        asked.append(_choice(body.guided_choice, "guided_choice"))
    if body.guided_grammar is not None:
        asked.append(Guided(kind="grammar", spec=body.guided_grammar, param="guided_grammar"))
    if body.structural_tag is not None:
        asked.append(Guided(kind="structural_tag", spec=body.structural_tag, param="structural_tag"))
    if len(asked) > 1:
        raise InvalidRequestError(f"{asked[1].param}: a request asks for one structured output, and "
                                  f"{asked[0].param} asks already", asked[1].param)
    return asked[0] if asked else None


async def check(guided: Guided) -> None:
    """Raise InvalidRequestError naming guided.param unless its spec compiles; off the event loop (the first
    call imports xgrammar, and a large schema takes milliseconds)."""
    await asyncio.to_thread(_check, guided)


@functools.lru_cache(maxsize=256)  # clients repeat their schemas; a spec that fails raises and is not kept
def _check(guided: Guided) -> None:
    grammar(guided)


def _response_format(rf: ResponseFormat) -> Guided:
    if rf.type == "json_object":
        return Guided(kind="json_object", param="response_format")
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise InvalidRequestError("response_format: type json_schema needs json_schema.schema",
                                      "response_format")
        return json_schema(rf.json_schema.schema_, "response_format")
    if rf.format is None and rf.structures is None:
        raise InvalidRequestError("response_format: type structural_tag needs format (or structures and "
                                  "triggers)", "response_format")
    spec = json.dumps(rf.model_dump(by_alias=True, exclude_none=True, exclude={"json_schema"}))
    return Guided(kind="structural_tag", spec=spec, param="response_format")


def _structured_outputs(so: StructuredOutputs) -> Guided:
    param = "structured_outputs"
    if so.whitespace_pattern is not None:
        raise InvalidRequestError(f"{param}.whitespace_pattern is not served (JSON comes out compact)",
                                  f"{param}.whitespace_pattern")
    asked = [name for name in ("json_", "regex", "choice", "grammar", "structural_tag")
             if getattr(so, name) is not None]
    asked += ["json_object"] if so.json_object else []
    if len(asked) != 1:
        raise InvalidRequestError(f"{param} takes exactly one of json, regex, choice, grammar, json_object, "
                                  f"structural_tag; got {len(asked)}", param)
    name = asked[0].rstrip("_")
    where = f"{param}.{name}"
    if name == "json":
        return json_schema(so.json_, where)
    if name == "choice":
        return _choice(so.choice, where)
    if name == "json_object":
        return Guided(kind="json_object", param=where)
    return Guided(kind=name, spec=getattr(so, name), param=where)


def _choice(choices: list[str], param: str) -> Guided:
    if not choices:
        raise InvalidRequestError(f"{param}: give at least one choice", param)
    return Guided(kind="choice", spec=json.dumps(choices), param=param)
