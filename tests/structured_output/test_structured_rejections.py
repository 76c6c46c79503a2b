"""Whatever a backend would not enforce is refused with InvalidArgument and a pointer."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmserve.errors import InvalidArgument
from mmserve.structured_output import (
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_NODES,
    SchemaError,
    StructuredOutputBackend,
    StructuredOutputParams,
)
from mmserve.structured_output.keywords import OUTLINES_RULES, XGRAMMAR_RULES
from mmserve.structured_output.prepare import check_schema
from mmserve.structured_output.schema_check import parse_schema

OBJ = {"type": "object"}


def props(**schemas: Any) -> dict[str, Any]:
    return {"type": "object", "properties": schemas}


# (schema, JSON pointer of the offending part), refused by both backends
BOTH_REFUSE: list[tuple[Any, str]] = [
    # syntax errors of patterns are the schema's, at their pointer (not the engine's later)
    (props(p={"type": "string", "pattern": "("}), "/properties/p/pattern"),
    (props(p={"type": "string", "pattern": "[z-a]"}), "/properties/p/pattern"),
    (props(tags={"type": "array", "uniqueItems": True}), "/properties/tags/uniqueItems"),
    ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 6}}, "/if"),
    ({"type": "integer", "not": {"const": 3}}, "/not"),
    ({"type": "array", "contains": {"type": "integer"}}, "/contains"),
    ({**OBJ, "dependentRequired": {f"a{i}": ["b"] for i in range(7)}}, "/dependentRequired"),
    ({**OBJ, "dependencies": {f"a{i}": ["b"] for i in range(7)}}, "/dependencies"),  # as written
    (props(a={"type": "string", "format": "idn-hostname"}), "/properties/a/format"),
    ({"type": "string", "format": "regex"}, "/format"),
    ({"type": "string", "enum": []}, "/enum"),
    ({"type": "strin"}, "/type"),
    ({"type": "string", "minLength": -1}, "/minLength"),
    (props(p={"type": "string", "pattern": "^(?!a)b$"}), "/properties/p/pattern"),
    (props(p={"type": "string", "pattern": "a$b"}), "/properties/p/pattern"),
    (props(p={"type": "string", "pattern": "\\Aab"}), "/properties/p/pattern"),
    # a pattern and length bounds it does not imply
    ({"type": "string", "pattern": "^[a-z]+[0-9]+$", "maxLength": 4}, "/maxLength"),
    ({"$ref": "https://example.com/s.json"}, "/$ref"),
    ({"$ref": "#/$defs/missing"}, "/$ref"),
    # two patterns cannot be one (allOf merges its parts)
    ({"allOf": [{"type": "string", "pattern": "a"}, {"pattern": "b"}]}, "/allOf/1/pattern"),
    # oneOf branches that may overlap: a value matching both would be let through
    ({"oneOf": [{"type": "number"}, {"type": "integer", "minimum": 10}]}, "/oneOf"),
    ({"oneOf": [{"required": ["a"]}, {"type": "object", "maxProperties": 3}]}, "/oneOf"),
]

XGRAMMAR_REFUSES: list[tuple[Any, str]] = [
    (
        {**props(ab={"type": "string", "maxLength": 3}),
         "patternProperties": {"^a": {"type": "string", "minLength": 2}},
         "additionalProperties": {"type": "boolean"}},
        "/patternProperties",
    ),
    ({**OBJ, "additionalProperties": {"type": "integer"}, "minProperties": 2}, "/minProperties"),
    ({"type": "number", "multipleOf": 0.5}, "/multipleOf"),
    ({"type": "integer", "minimum": 0, "multipleOf": 7}, "/multipleOf"),
    ({"type": "string", "format": "email", "maxLength": 20}, "/maxLength"),
]  # fmt: skip

OUTLINES_REFUSES: list[tuple[Any, str]] = [
    ({"type": "integer", "multipleOf": 3}, "/multipleOf"),
    ({"type": "number", "minimum": 0.2, "maximum": 0.8}, "/minimum"),
    ({**OBJ, "maxProperties": 2}, "/maxProperties"),
    ({**OBJ, "patternProperties": {"^x": {"type": "integer"}, "^y": {}}}, "/patternProperties"),
    ({"type": "string", "maxLength": 10_000}, "/maxLength"),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "minItems": 2}, "/minItems"),
]


def expect_pointer(schema: Any, rules: Any, pointer: str) -> SchemaError:
    with pytest.raises(SchemaError) as info:
        check_schema(schema, rules)
    assert info.value.pointer == pointer, str(info.value)
    assert info.value.field == "structured.json_schema"
    assert f"at {pointer}:" in str(info.value)
    return info.value


@pytest.mark.parametrize(("schema", "pointer"), BOTH_REFUSE + XGRAMMAR_REFUSES)
def test_xgrammar_rules_refuse(schema: Any, pointer: str) -> None:
    expect_pointer(schema, XGRAMMAR_RULES, pointer)


@pytest.mark.parametrize(("schema", "pointer"), BOTH_REFUSE + OUTLINES_REFUSES)
def test_outlines_rules_refuse(schema: Any, pointer: str) -> None:
    expect_pointer(schema, OUTLINES_RULES, pointer)


def test_refusal_names_the_keyword_and_what_is_supported() -> None:
    error = expect_pointer(
        props(t={"type": "array", "uniqueItems": True}), XGRAMMAR_RULES, "/properties/t/uniqueItems"
    )
    assert "'uniqueItems' is not supported by the xgrammar backend" in str(error)
    assert "maxItems" in str(error)  # the supported list
    error = expect_pointer({"type": "string", "format": "regex"}, XGRAMMAR_RULES, "/format")
    assert "date-time" in str(error)  # the supported formats


ACCEPTED = [
    {"type": "object", "properties": {"a": {"type": "integer", "title": "A", "x-note": 1}}},
    {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "string"},
    {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None, "description": "d"},
    {"type": "string", "enum": ["a", "b"]},
    {"type": "number", "const": 2},
    {"$defs": {"p": {"type": "integer"}}, "allOf": [{"$ref": "#/$defs/p"}]},
    {"type": "object", "additionalProperties": {"type": "integer"}},
    True,
    # what validators ignore: unknown keywords (typos included) and formats, annotations,
    # the identifiers of every draft at any depth
    {"type": "object", "self": {"vendor": "x"}, "_format": "y", "javaType": "Z",
     "additonalProperties": False, "links": [], "example": 1, "nullable": True},
    {"id": "http://x/y#", "$schema": "http://json-schema.org/draft-04/schema#",
     "properties": {"a": {"$schema": "http://json-schema.org/draft-04/schema#", "id": "#a",
                          "type": "string", "format": "int32"}}},
    props(a={"$id": "x", "type": "integer"}),
    {"type": "string", "contentEncoding": "base64", "contentMediaType": "image/png"},
    # enforced exactly after rewriting (see test_normalize.py)
    {"properties": {"a": {"type": "integer"}}, "required": ["a"]},  # narrowed to objects
    {"minLength": 3},
    {"type": "integer", "minimum": 3, "enum": [1, 5]},  # the enum is filtered
    {"type": "integer", "anyOf": [{"type": "integer"}, {"type": "string"}]},
    {"$defs": {"p": {"type": "string"}}, "$ref": "#/$defs/p", "maxLength": 3},
    {"allOf": [{"type": "integer"}, {"type": "number"}]},
    {"type": "string", "pattern": "^[a-z]+$", "maxLength": 4},
    {**props(a={"type": "integer"}), "required": ["b"]},
    {"type": "array", "items": [{"type": "integer"}], "additionalItems": False},
    {"type": "integer", "maximum": 5, "exclusiveMaximum": True},
    {"type": "string", "format": "date-time"},
    {"type": "string", "pattern": "^(normal|italic)$|^bold$"},
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True},
    {"oneOf": [{"type": "integer"}, {"type": "string"}]},
    {**OBJ, "dependencies": {"a": ["b"], "c": {"required": ["d"]}}},  # as anyOf (expand.py)
    {"oneOf": [{"required": ["a"]}, {"required": ["b", "c"]}]},
    {"type": "string", "pattern": "^[A-Z][a-z0-9]*$", "maxLength": 8},
    {"not": {"type": "null"}},
]  # fmt: skip


@pytest.mark.parametrize("schema", ACCEPTED)
@pytest.mark.parametrize("rules", [XGRAMMAR_RULES, OUTLINES_RULES], ids=["xgrammar", "outlines"])
def test_plain_schemas_pass(schema: Any, rules: Any) -> None:
    check_schema(schema, rules)


def test_disjoint_one_of_passes_xgrammar() -> None:
    by_type = {"oneOf": [{"type": "integer"}, {"type": ["string", "null"]}]}
    tagged = {
        "$defs": {
            "a": {"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
            "b": {"type": "object", "properties": {"k": {"enum": ["b"]}}, "required": ["k"]},
        },
        "oneOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}],
    }
    check_schema(by_type, XGRAMMAR_RULES)
    check_schema(tagged, XGRAMMAR_RULES)


def test_depth_and_size_limits() -> None:
    deep: Any = {"type": "integer"}
    for _ in range(MAX_SCHEMA_DEPTH + 1):
        deep = {"type": "array", "items": deep}
    error = expect_pointer(deep, XGRAMMAR_RULES, "/items" * (MAX_SCHEMA_DEPTH + 1))
    assert "deeper" in str(error)
    wide = props(**{f"p{i}": {"type": "integer"} for i in range(MAX_SCHEMA_NODES)})
    assert "subschemas" in str(
        expect_pointer(wide, XGRAMMAR_RULES, f"/properties/p{MAX_SCHEMA_NODES - 1}")
    )


def test_parse_errors() -> None:
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        parse_schema("{")
    with pytest.raises(InvalidArgument, match="nested too deeply"):
        parse_schema("[" * 100_000 + "]" * 100_000)
    with pytest.raises(SchemaError, match="JSON object or a boolean"):
        parse_schema("3")


def test_backends_refuse_with_pointer(backend: StructuredOutputBackend) -> None:
    schema = props(tags={"type": "array", "items": {"type": "string"}, "uniqueItems": True})
    with pytest.raises(SchemaError) as info:
        backend.compile(StructuredOutputParams("json_schema", json.dumps(schema)))
    assert info.value.pointer == "/properties/tags/uniqueItems"


def test_engine_errors_become_invalid_argument(backend: StructuredOutputBackend) -> None:
    bad_range = {"type": "array", "minItems": 5, "maxItems": 1}
    cases = [
        ("json_schema", json.dumps(bad_range), "structured.json_schema"),
        ("regex", "(a", "structured.regex"),
        ("regex", "a{3,1}", "structured.regex"),
        ("regex", "(a)\\1", "structured.regex"),  # backreference
        ("regex", "a$b", "structured.regex"),  # would be ignored: refused by us
    ]
    for kind, value, field in cases:
        with pytest.raises(InvalidArgument) as info:
            backend.compile(StructuredOutputParams(kind, value))
        assert info.value.field == field, (kind, value)
        assert "[" not in str(info.value).split(":")[1][:3]  # no engine log prefix


def test_ebnf_errors(tokenizer: Any) -> None:
    from tests.structured_output.conftest import get_backend

    xgrammar = get_backend(tokenizer, "xgrammar")
    with pytest.raises(InvalidArgument, match='Rule "foo" is not defined'):
        xgrammar.compile(StructuredOutputParams("grammar", "root ::= foo"))
    with pytest.raises(InvalidArgument, match="line 1"):
        xgrammar.compile(StructuredOutputParams("grammar", 'root ::= ("a"'))
    outlines = get_backend(tokenizer, "outlines")
    with pytest.raises(InvalidArgument, match="does not support EBNF"):
        outlines.compile(StructuredOutputParams("grammar", 'root ::= "a"'))


def test_outlines_refuses_a_choice_with_nul(tokenizer: Any) -> None:
    """NUL is the outlines backend's end mark (outlines_worker.py): never written."""
    from tests.structured_output.conftest import get_backend

    outlines = get_backend(tokenizer, "outlines")
    with pytest.raises(InvalidArgument, match="cannot write NUL"):
        outlines.compile(StructuredOutputParams("choice", ["a", "b\x00"]))


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (StructuredOutputParams("yaml", "x"), "unknown constraint"),
        (StructuredOutputParams("regex", "a", backend="llguidance"), "unknown backend"),
        (StructuredOutputParams("regex", ""), "non-empty"),
        (StructuredOutputParams("regex", "a" * 10_000), "longer than the limit"),
        (StructuredOutputParams("json_schema", " " * 600_000), "longer than the limit"),
        (StructuredOutputParams("choice", []), "non-empty list"),
        (StructuredOutputParams("choice", "ab"), "non-empty list"),
        (StructuredOutputParams("choice", ["a", ""]), r"structured.choice\[1\]"),
        (StructuredOutputParams("choice", ["a"] * 2000), "at most"),
    ],
)
def test_params_validation(params: StructuredOutputParams, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        params.validate()


def test_choice_list_becomes_hashable_tuple() -> None:
    params = StructuredOutputParams("choice", ["a", "b"])
    assert params.value == ("a", "b")
    assert hash(params) == hash(StructuredOutputParams("choice", ("a", "b")))


KEYS = st.sampled_from(
    ["type", "properties", "items", "enum", "const", "anyOf", "oneOf", "allOf", "$ref",
     "$defs", "required", "pattern", "format", "minimum", "multipleOf", "minLength",
     "patternProperties", "propertyNames", "minProperties", "additionalProperties", "x",
     "object", "string", "integer", "#", "#/$defs/x", "^a", "date"]
)  # fmt: skip
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | KEYS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=4),
    max_leaves=12,
)


def resolve(schema: Any, pointer: str) -> Any:
    """The node at an RFC 6901 JSON pointer (KeyError/IndexError/ValueError when none)."""
    node = schema
    for token in pointer.split("/")[1:] if pointer else []:
        token = token.replace("~1", "/").replace("~0", "~")
        node = node[int(token)] if isinstance(node, list) else node[token]
    return node


@settings(max_examples=300, deadline=None)
@given(schema=JSON)
def test_any_json_is_refused_at_a_node_it_has(schema: Any) -> None:
    """Whatever the input, a refusal is a SchemaError whose pointer names a node of it."""
    for rules in (XGRAMMAR_RULES, OUTLINES_RULES):
        try:
            check_schema(schema, rules)
        except SchemaError as e:
            resolve(schema, e.pointer)
