"""Recursive $ref: enforced by xgrammar, refused by outlines (which would unroll it)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from mmserve.errors import InvalidArgument
from mmserve.structured_output import SchemaError, StructuredOutputParams
from mmserve.structured_output.refs import find_recursive_ref, resolve_local_ref
from tests.structured_output.conftest import get_backend

CHAIN = {  # every object needs "next", so no finite instance has a last level
    "type": "object",
    "properties": {"v": {"type": "integer"}, "next": {"$ref": "#"}},
    "required": ["v", "next"],
    "additionalProperties": False,
}
TREE = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "v": {"type": "integer"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
            },
            "required": ["v"],
        }
    },
    "$ref": "#/$defs/node",
}
MUTUAL = {
    "$defs": {
        "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}},
        "b": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/a"}]},
    },
    "type": "object",
    "properties": {"top": {"$ref": "#/$defs/a"}},
}

RECURSIVE = [
    (CHAIN, "/properties/next/$ref"),
    (TREE, "/$defs/node/properties/children/items/$ref"),
    (MUTUAL, "/$defs/b/anyOf/1/$ref"),
    ({"type": "array", "items": {"$ref": "#"}}, "/items/$ref"),
    ({"anyOf": [{"type": "integer"}, {"type": "array", "items": {"$ref": "#/anyOf/1"}}]},
     "/anyOf/1/items/$ref"),
]  # fmt: skip
NOT_RECURSIVE = [
    {"$defs": {"p": {"type": "integer"}}, "properties": {"x": {"$ref": "#/$defs/p"},
                                                          "y": {"$ref": "#/$defs/p"}}},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"type": "string"}}, "$ref": "#/$defs/a"},
    {"$defs": {"unused": {"type": "array", "items": {"$ref": "#/$defs/unused"}}},
     "type": "integer"},  # never expanded, so never unrolled
    {"$ref": "#/$defs/missing"},  # reported by the schema walk, not here
]  # fmt: skip


@pytest.mark.parametrize(("schema", "pointer"), RECURSIVE)
def test_finds_the_recursive_reference(schema: Any, pointer: str) -> None:
    assert find_recursive_ref(schema) == pointer


@pytest.mark.parametrize("schema", NOT_RECURSIVE)
def test_shared_and_unused_references_are_not_recursion(schema: Any) -> None:
    assert find_recursive_ref(schema) is None


def test_a_reference_resolves_to_a_pointer() -> None:
    schema = {"$defs": {"a/b": {"type": "null"}}, "anyOf": [True, False]}
    assert resolve_local_ref(schema, "#/$defs/a~1b") == ("/$defs/a~1b", {"type": "null"})
    assert resolve_local_ref(schema, "#/anyOf/1") == ("/anyOf/1", False)
    assert resolve_local_ref(schema, "#/anyOf/01") is None  # RFC 6901: no leading zeros
    assert resolve_local_ref(schema, "#") == ("", schema)
    assert resolve_local_ref(schema, "#/anyOf/2") is None
    assert resolve_local_ref(schema, "other.json#/a") is None


@pytest.mark.parametrize(("schema", "pointer"), RECURSIVE)
def test_outlines_refuses_recursive_references(tokenizer: Any, schema: Any, pointer: str) -> None:
    params = StructuredOutputParams("json_schema", json.dumps(schema), backend="outlines")
    with pytest.raises(SchemaError) as caught:
        get_backend(tokenizer, "outlines").compile(params)
    assert isinstance(caught.value, InvalidArgument)
    assert caught.value.pointer == pointer
    assert caught.value.field == "structured.json_schema"
    assert "recursive reference" in str(caught.value) and "xgrammar" in str(caught.value)


@pytest.mark.parametrize(("schema", "pointer"), RECURSIVE)
def test_xgrammar_accepts_recursive_references(tokenizer: Any, schema: Any, pointer: str) -> None:
    params = StructuredOutputParams("json_schema", json.dumps(schema))
    get_backend(tokenizer, "xgrammar").compile(params)


def test_outlines_core_still_unrolls_recursion() -> None:
    """Why outlines refuses: its regex for CHAIN stops after a few levels with the required
    "next" gone and a dangling comma, which is not JSON. If this starts failing, a newer
    outlines-core handles recursion differently: revisit OUTLINES_RULES.recursive_refs."""
    from outlines_core.json_schema import build_regex_from_schema

    regex = build_regex_from_schema(json.dumps(CHAIN), None)
    text = '{"v":1,}'
    for _ in range(4):
        text = '{"v":1,"next":' + text + "}"
    assert re.fullmatch(regex, text)
    with pytest.raises(ValueError):
        json.loads(text)
