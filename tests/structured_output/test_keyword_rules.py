"""The experiment behind keywords.py, re-run: every keyword and format a backend's rules
list is really enforced (a violating instance is refused, a valid one accepted), so an
engine upgrade that changes behaviour fails here instead of weakening schemas silently."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mmserve.structured_output import CompiledGrammar, StructuredOutputParams
from mmserve.structured_output.keywords import OUTLINES_RULES, XGRAMMAR_RULES, SchemaRules
from tests.structured_output.conftest import SMOLLM2_EOS, get_backend

INT = {"type": "integer"}
# keyword -> (schema, valid instance, violating instance)
KEYWORD_CASES: dict[str, tuple[dict[str, Any], str, str]] = {
    "enum": ({"enum": ["a", 1]}, "1", '"b"'),
    "const": ({"const": {"a": 1}}, '{"a":1}', '{"a":2}'),
    "anyOf": ({"anyOf": [INT, {"type": "string"}]}, '"x"', "true"),
    "oneOf": ({"oneOf": [INT, {"type": "string"}]}, '"x"', "true"),
    "allOf": ({"allOf": [INT]}, "3", '"x"'),
    "$ref": ({"$defs": {"p": INT}, "$ref": "#/$defs/p"}, "1", '"x"'),
    "minimum": ({"type": "number", "minimum": 1.5}, "1.7", "1.2"),
    "maximum": ({"type": "integer", "maximum": 3}, "3", "4"),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 3}, "4", "3"),
    "exclusiveMaximum": ({"type": "number", "exclusiveMaximum": 1.5}, "1.2", "1.5"),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, "6", "4"),
    "minLength": ({"type": "string", "minLength": 3}, '"abc"', '"ab"'),
    "maxLength": ({"type": "string", "maxLength": 3}, '"abc"', '"abcd"'),
    "pattern": ({"type": "string", "pattern": "^a+$"}, '"aa"', '"ab"'),
    "format": (
        {"type": "string", "format": "uuid"},
        '"123e4567-e89b-12d3-a456-426614174000"',
        '"x"',
    ),
    "properties": ({"type": "object", "properties": {"a": INT}}, '{"a":1}', '{"a":"x"}'),
    "required": ({"type": "object", "properties": {"a": INT}, "required": ["a"]}, '{"a":1}', "{}"),
    "additionalProperties": (
        {"type": "object", "properties": {"a": INT}, "additionalProperties": False},
        '{"a":1}',
        '{"b":1}',
    ),
    "patternProperties": (
        {"type": "object", "patternProperties": {"^x": INT}, "additionalProperties": False},
        '{"x":1}',
        '{"x":"s"}',
    ),
    "propertyNames": (
        {"type": "object", "propertyNames": {"pattern": "^x"}, "additionalProperties": INT},
        '{"x":1}',
        '{"y":1}',
    ),
    "minProperties": (
        {"type": "object", "properties": {"a": INT, "b": INT}, "minProperties": 1},
        '{"b":1}',
        "{}",
    ),
    "maxProperties": (
        {"type": "object", "additionalProperties": INT, "maxProperties": 1},
        '{"a":1}',
        '{"a":1,"b":2}',
    ),
    "unevaluatedProperties": (
        {"type": "object", "properties": {"a": INT}, "unevaluatedProperties": False},
        '{"a":1}',
        '{"b":1}',
    ),
    "items": ({"type": "array", "items": INT}, "[1,2]", '[1,"x"]'),
    "prefixItems": ({"type": "array", "prefixItems": [INT], "items": False}, "[1]", '["a"]'),
    "minItems": ({"type": "array", "items": INT, "minItems": 2}, "[1,2]", "[1]"),
    "maxItems": ({"type": "array", "items": INT, "maxItems": 2}, "[1,2]", "[1,2,3]"),
    "unevaluatedItems": (
        {"type": "array", "prefixItems": [INT], "unevaluatedItems": {"type": "string"}},
        '[1,"a"]',
        "[1,2]",
    ),
}

# format -> (valid, violating)
FORMAT_CASES = {
    "email": ("a@b.co", "a b"),
    "ipv6": ("::1", "1.2.3"),
    "uuid": ("123e4567-e89b-12d3-a456-426614174000", "123e4567"),
    "uri": ("http://a.b/c", "a b"),
    "uri-reference": ("a/b", "a b"),
    "uri-template": ("http://a/{b}", "http://a/{"),
    "json-pointer": ("/a/b", "a"),
    "relative-json-pointer": ("0/a", "/a"),
    "duration": ("P1D", "1D"),
}

RULES = {"xgrammar": XGRAMMAR_RULES, "outlines": OUTLINES_RULES}


def accepts(compiled: CompiledGrammar, tokenizer: Any, text: str) -> bool:
    """Whether the grammar takes `text` (tokenised as a model might) and may end there."""
    matcher = compiled.matcher()
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept_token(t) for t in tokens) and matcher.accept_token(SMOLLM2_EOS[0])


def cases(rules: SchemaRules) -> list[tuple[str, Any, str, str]]:
    out = [(kw, *KEYWORD_CASES[kw]) for kw in sorted(rules.keywords)]
    for fmt in sorted(rules.formats):
        good, bad = FORMAT_CASES[fmt]
        out.append(
            (f"format={fmt}", {"type": "string", "format": fmt}, json.dumps(good), json.dumps(bad))
        )
    return out


def test_every_listed_keyword_and_format_has_a_case() -> None:
    for rules in RULES.values():
        assert rules.keywords <= KEYWORD_CASES.keys()
        assert rules.formats <= FORMAT_CASES.keys()


@pytest.mark.parametrize("name", sorted(RULES))
def test_listed_keywords_are_enforced(name: str, tokenizer: Any) -> None:
    backend = get_backend(tokenizer, name)
    for keyword, schema, good, bad in cases(RULES[name]):
        compiled = backend.compile(StructuredOutputParams("json_schema", json.dumps(schema)))
        assert accepts(compiled, tokenizer, good), (name, keyword, good)
        assert not accepts(compiled, tokenizer, bad), (name, keyword, bad)


def test_length_limited_strings_refuse_raw_control_characters(tokenizer: Any) -> None:
    # xgrammar 0.2.9 lets them into length-limited strings; the backend patches its EBNF.
    backend = get_backend(tokenizer, "xgrammar")
    schema = {"type": "string", "minLength": 1, "maxLength": 4}
    compiled = backend.compile(StructuredOutputParams("json_schema", json.dumps(schema)))
    assert accepts(compiled, tokenizer, '"ab"')
    assert not accepts(compiled, tokenizer, '"a\x05"')
