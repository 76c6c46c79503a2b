"""Recursive $ref: enforced by xgrammar; for outlines written out a few levels deep and cut
there (outlines_schema.py), which is a narrowing: every output still validates."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest

from mmserve.errors import InvalidArgument
from mmserve.structured_output import SchemaError, StructuredOutputBackend, StructuredOutputParams
from mmserve.structured_output.refs import resolve_local_ref
from tests.structured_output.conftest import get_backend
from tests.structured_output.walk import Vocab, walk

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
    TREE,
    MUTUAL,
    {"type": "array", "items": {"$ref": "#"}},
    {"anyOf": [{"type": "integer"}, {"type": "array", "items": {"$ref": "#/anyOf/1"}}]},
]


def test_a_reference_resolves_to_a_pointer() -> None:
    schema = {"$defs": {"a/b": {"type": "null"}}, "anyOf": [True, False]}
    assert resolve_local_ref(schema, "#/$defs/a~1b") == ("/$defs/a~1b", {"type": "null"})
    assert resolve_local_ref(schema, "#/anyOf/1") == ("/anyOf/1", False)
    assert resolve_local_ref(schema, "#/anyOf/01") is None  # RFC 6901: no leading zeros
    assert resolve_local_ref(schema, "#") == ("", schema)
    assert resolve_local_ref(schema, "#/anyOf/2") is None
    assert resolve_local_ref(schema, "other.json#/a") is None


@pytest.mark.parametrize("schema", RECURSIVE)
def test_outlines_cuts_recursion_soundly(tokenizer: Any, vocab: Vocab, schema: Any) -> None:
    compiled = get_backend(tokenizer, "outlines").compile(
        StructuredOutputParams("json_schema", json.dumps(schema), backend="outlines")
    )
    validator = jsonschema.Draft202012Validator(schema)
    for seed in range(3):
        text = vocab.text(walk(compiled.matcher(), vocab, seed))
        validator.validate(json.loads(text))


ENDLESS = [  # recursive schemas without a finite value
    CHAIN,
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    {"$defs": {"a": {"type": "object", "properties": {"b": {"anyOf": [{"$ref": "#/$defs/a"}]}},
                     "required": ["b"]}}, "properties": {"x": {"$ref": "#/$defs/a"}},
     "required": ["x"]},
]  # fmt: skip


@pytest.mark.parametrize("schema", ENDLESS)
def test_recursion_without_an_end_is_refused(backend: StructuredOutputBackend, schema: Any) -> None:
    """xgrammar compiled these, and a model then wrote until max_tokens."""
    params = StructuredOutputParams("json_schema", json.dumps(schema))
    with pytest.raises(SchemaError, match="accepts no finite value") as caught:
        backend.compile(params)
    assert isinstance(caught.value, InvalidArgument)
    assert caught.value.field == "structured.json_schema"


@pytest.mark.parametrize("schema", RECURSIVE)
def test_xgrammar_accepts_recursive_references(tokenizer: Any, schema: Any) -> None:
    params = StructuredOutputParams("json_schema", json.dumps(schema))
    get_backend(tokenizer, "xgrammar").compile(params)


def test_outlines_core_still_unrolls_recursion() -> None:
    """Why references are written out for outlines: its own regex for CHAIN stops after a
    few levels with the required "next" gone and a dangling comma, which is not JSON. If this
    starts failing, a newer outlines-core handles recursion differently: revisit
    outlines_schema.py."""
    from outlines_core.json_schema import build_regex_from_schema

    regex = build_regex_from_schema(json.dumps(CHAIN), None)
    text = '{"v":1,}'
    for _ in range(4):
        text = '{"v":1,"next":' + text + "}"
    assert re.fullmatch(regex, text)
    with pytest.raises(ValueError):
        json.loads(text)
