"""Constrained "generation" with SmolLM2's tokenizer and a random walk instead of a model:
every output must satisfy its constraint (jsonschema, re.fullmatch, choice, EBNF parse)."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

import jsonschema
import pytest

from mmserve.structured_output import StructuredOutputBackend, StructuredOutputParams
from tests.structured_output.conftest import SMOLLM2_VOCAB, get_backend
from tests.structured_output.walk import Vocab, walk

SEEDS = (0, 1)

BOTH = ("xgrammar", "outlines")
# Formats xgrammar enforces exactly, as jsonschema[format] checks them.
CHECKED_FORMATS = ("email", "ipv6", "uuid", "uri", "duration", "json-pointer")
FORMATS = jsonschema.FormatChecker()

SCHEMAS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "nested_object": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 12},
                "address": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    },
                    "required": ["city", "zip"],
                    "additionalProperties": False,
                },
                "nickname": {"type": "string", "maxLength": 6},
            },
            "required": ["name", "address"],
        },
        BOTH,
    ),
    "array_bounds": (
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "tags": {
                        "type": "array",
                        "items": {"type": "string", "enum": ["a", "b", "c"]},
                        "minItems": 1,
                        "maxItems": 3,
                    },
                },
                "required": ["id", "tags"],
            },
            "minItems": 2,
            "maxItems": 4,
        },
        BOTH,
    ),
    "number_bounds": (
        {
            "type": "object",
            "properties": {
                "temp": {"type": "number", "minimum": -10.5, "maximum": 40},
                "count": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
                "step": {"type": "integer", "multipleOf": 5},
            },
            "required": ["temp", "count", "step"],
        },
        ("xgrammar",),  # outlines-core does not enforce numeric bounds
    ),
    "enum_const_anyof": (
        {
            "type": "object",
            "properties": {
                "status": {"enum": ["ok", "error", None, 3]},
                "code": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                "kind": {"const": "event"},
                "flag": {"type": "boolean"},
            },
            "required": ["status", "code", "kind", "flag"],
        },
        BOTH,
    ),
    "string_patterns": (
        {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                "word": {"type": "string", "pattern": "[a-z]+"},
                "id": {"type": "string", "format": "uuid"},
            },
            "required": ["sku", "word", "id"],
        },
        BOTH,
    ),
    "formats": (
        {
            "type": "object",
            "properties": {name: {"type": "string", "format": name} for name in CHECKED_FORMATS},
            "required": list(CHECKED_FORMATS),
        },
        ("xgrammar",),
    ),
    "recursive_ref": (
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "v": {"type": "integer"},
                        "children": {
                            "type": "array",
                            "items": {"$ref": "#/$defs/node"},
                            "maxItems": 2,
                        },
                    },
                    "required": ["v"],
                }
            },
            "$ref": "#/$defs/node",
        },
        ("xgrammar",),  # outlines refuses recursion (test_recursive_refs.py)
    ),
    "discriminated_oneof": (
        {
            "type": "object",
            "properties": {
                "shape": {
                    "oneOf": [
                        {
                            "type": "object",
                            "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}},
                            "required": ["kind", "r"],
                        },
                        {
                            "type": "object",
                            "properties": {
                                "kind": {"const": "square"},
                                "side": {"type": "integer"},
                            },
                            "required": ["kind", "side"],
                        },
                    ]
                }
            },
            "required": ["shape"],
        },
        ("xgrammar",),
    ),
    "object_maps": (
        {
            "type": "object",
            "patternProperties": {"^x_[a-z]+$": {"type": "integer"}},
            "maxProperties": 3,
            "additionalProperties": False,
        },
        ("xgrammar",),
    ),
    "tool_arguments": (
        {
            "type": "object",
            "properties": {
                "location": {"type": "string", "minLength": 1, "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
            },
            "required": ["location"],
            "additionalProperties": False,
        },
        BOTH,
    ),
}

CASES = [(name, b) for name, (_, backends) in SCHEMAS.items() for b in backends]


def generate(
    backend: StructuredOutputBackend,
    params: StructuredOutputParams,
    vocab: Vocab,
    tokenizer: Any,
    seed: int,
) -> str:
    matcher = backend.compile(params).matcher()
    tokens = walk(matcher, vocab, seed)
    assert all(t < SMOLLM2_VOCAB for t in tokens)  # never a padding id
    text = b"".join(vocab.table[t] or b"" for t in tokens).decode("utf-8")  # whole chars only
    # What the detokeniser will show: no special token slipped in as "text".
    assert tokenizer.decode(tokens, skip_special_tokens=True) == text
    return text


@pytest.mark.parametrize(("name", "backend_name"), CASES)
def test_json_schema_outputs_validate(
    name: str, backend_name: str, tokenizer: Any, vocab: Vocab
) -> None:
    backend = get_backend(tokenizer, backend_name)
    schema = SCHEMAS[name][0]
    params = StructuredOutputParams("json_schema", json.dumps(schema))
    for seed in SEEDS:
        text = generate(backend, params, vocab, tokenizer, seed)
        jsonschema.validate(json.loads(text), schema, format_checker=FORMATS)


@pytest.mark.parametrize(
    "backend_name",
    # outlines-core compiles "any JSON object" to a 7k-character regex: 3-10 s to index.
    ["xgrammar", pytest.param("outlines", marks=pytest.mark.slow)],
)
def test_json_object(backend_name: str, tokenizer: Any, vocab: Vocab) -> None:
    backend = get_backend(tokenizer, backend_name)
    params = StructuredOutputParams("json_object")
    for seed in SEEDS:
        assert isinstance(json.loads(generate(backend, params, vocab, tokenizer, seed)), dict)


@pytest.mark.parametrize(
    "pattern",
    [
        r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)",
        r"^\d{3}-\d{4}$",
        r"(yes|no|maybe)!?",
        r"[A-Z][a-z]+( [A-Z][a-z]+){0,2}",
        r"[^\s]{2,5}é",
    ],
)
def test_regex_outputs_fullmatch(
    pattern: str, backend: StructuredOutputBackend, tokenizer: Any, vocab: Vocab
) -> None:
    params = StructuredOutputParams("regex", pattern)
    for seed in SEEDS:
        text = generate(backend, params, vocab, tokenizer, seed)
        assert re.fullmatch(pattern, text), text


def test_choice_outputs_are_choices(
    backend: StructuredOutputBackend, tokenizer: Any, vocab: Vocab
) -> None:
    choices = ["yes", "no", 'a "quoted" one', "日本語", "x|y", "a.b*", "back\\slash", "two\nlines"]
    params = StructuredOutputParams("choice", choices)
    seen = {generate(backend, params, vocab, tokenizer, seed) for seed in range(12)}
    assert seen <= set(choices) and len(seen) > 1


ARITHMETIC = """
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [1-9] [0-9]* | "(" expr ")"
"""


def test_ebnf_outputs_parse(tokenizer: Any, vocab: Vocab) -> None:
    backend = get_backend(tokenizer, "xgrammar")
    params = StructuredOutputParams("grammar", ARITHMETIC)
    for seed in range(5):
        text = generate(backend, params, vocab, tokenizer, seed)
        tree = ast.parse(text, mode="eval")  # Python's grammar contains this one
        kinds = {type(node) for node in ast.walk(tree)}
        allowed = {ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div}
        assert kinds <= allowed, text
