"""Structured output at the frontend: every field that asks for it (OpenAI's response_format, vLLM's
structured_outputs and its guided_* / structural_tag fields) reaches the engine as one Guided, on chat and
completions; a spec that does not compile, a schema keyword the grammar would ignore, two forms at once or a
form this server does not serve is a 400 naming the field, and no worker sees the request."""

from __future__ import annotations

import json

import pytest

from dynamo_pd.frontend.app import FrontendConfig, create_app
from dynamo_pd.frontend.structured import json_schema
from dynamo_pd.protocol import Guided
from tests.frontend.test_fields import BODIES, Backend, post, tokenizer  # noqa: F401 - the fixture

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}},
          "required": ["b"]}
TAG = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f>"], "tags": [
    {"begin": "<f>", "content": {"type": "json_schema", "json_schema": {"type": "object"}}, "end": "</f>"}]}}
LEGACY_TAG = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
              "triggers": ["<f>"]}

SERVED = [  # (fields sent, the Guided the engine is asked for)
    ({"response_format": {"type": "json_object"}}, Guided(kind="json_object", param="response_format")),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}},
     Guided(kind="json_schema", spec=json.dumps(SCHEMA), param="response_format")),
    ({"response_format": TAG}, Guided(kind="structural_tag", spec=json.dumps(TAG), param="response_format")),
    ({"response_format": LEGACY_TAG},
     Guided(kind="structural_tag", spec=json.dumps(LEGACY_TAG), param="response_format")),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     Guided(kind="json_schema", spec=json.dumps(SCHEMA), param="structured_outputs.json")),
    ({"structured_outputs": {"regex": "[0-9]{3}"}},
     Guided(kind="regex", spec="[0-9]{3}", param="structured_outputs.regex")),
    ({"structured_outputs": {"choice": ["a", "b"]}},
     Guided(kind="choice", spec='["a", "b"]', param="structured_outputs.choice")),
    ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}},
     Guided(kind="grammar", spec='root ::= "a" | "b"', param="structured_outputs.grammar")),
    ({"structured_outputs": {"json_object": True}},
     Guided(kind="json_object", param="structured_outputs.json_object")),
    ({"structured_outputs": {"structural_tag": json.dumps(TAG)}},
     Guided(kind="structural_tag", spec=json.dumps(TAG), param="structured_outputs.structural_tag")),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"},
     Guided(kind="json_schema", spec=json.dumps(SCHEMA), param="guided_json")),
    ({"guided_json": json.dumps(SCHEMA)},
     Guided(kind="json_schema", spec=json.dumps(SCHEMA), param="guided_json")),
    ({"guided_regex": "a+"}, Guided(kind="regex", spec="a+", param="guided_regex")),
    ({"guided_choice": ["yes", 'say "no"\n']}, Guided(kind="choice", spec='["yes", "say \\"no\\"\\n"]',
                                                     param="guided_choice")),
    ({"guided_grammar": 'root ::= "a"'}, Guided(kind="grammar", spec='root ::= "a"', param="guided_grammar")),
    ({"structural_tag": json.dumps(TAG)},
     Guided(kind="structural_tag", spec=json.dumps(TAG), param="structural_tag")),
    ({"guided_json": {"properties": {"not": {"type": "integer"}}}},  # a property's name is no keyword
     Guided(kind="json_schema", spec='{"properties": {"not": {"type": "integer"}}}', param="guided_json")),
    ({"response_format": {"type": "text"}}, None),  # asks for nothing
]

REFUSED = [  # (fields sent, the field the 400 names)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "foo"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "object", "properties": {"not": {"not": {"type": "integer"}}}}}}}, "response_format"),
    ({"response_format": {"type": "structural_tag"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_regex": "(?=a)b"}, "guided_regex"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"structural_tag": "{}"}, "structural_tag"),
    ({"structural_tag": "x" * 70000}, "structural_tag"),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"regex": "a", "backend": "xgrammar"}}, "structured_outputs.backend"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"guided_json": SCHEMA, "structured_outputs": {"regex": "a"}}, "guided_json"),
]


@pytest.mark.parametrize("route", ["chat", "completion"])
@pytest.mark.parametrize("fields, guided", SERVED, ids=[json.dumps(f)[:60] for f, _ in SERVED])
async def test_every_form_reaches_the_engine_as_one_guided(tokenizer, route, fields, guided):  # noqa: F811
    backend = Backend(tokenizer)
    path, body = BODIES[route]
    status, answer = await post(create_app(backend, FrontendConfig()), path, {**body, **fields})
    assert status == 200, answer
    [request] = backend.requests
    assert request.sampling.guided == guided


@pytest.mark.parametrize("route", ["chat", "completion"])
@pytest.mark.parametrize("fields, param", REFUSED, ids=[json.dumps(f)[:60] for f, _ in REFUSED])
async def test_a_spec_that_cannot_be_enforced_is_a_400_naming_its_field(tokenizer, route, fields, param):  # noqa: F811
    backend = Backend(tokenizer)
    path, body = BODIES[route]
    status, answer = await post(create_app(backend, FrontendConfig()), path, {**body, **fields})
    assert status == 400, answer
    assert answer["error"]["param"] == param and answer["error"]["type"] == "invalid_request_error", answer
    assert backend.requests == []


def test_a_schema_attached_by_other_code_is_the_same_guided_as_a_clients():
    """What tool_choice "required" / named will attach: the same struct the client's json_schema gives."""
    assert json_schema(SCHEMA, "tools") == Guided(kind="json_schema", spec=json.dumps(SCHEMA), param="tools")
    assert json_schema(json.dumps(SCHEMA), "tools").spec == json.dumps(SCHEMA)
