"""What prepare_schema hands the engines: one spelling, siblings merged, exact rewrites, and
what `relaxed` drops (with its pointer into the request's schema). No tokenizer needed."""

from __future__ import annotations

import random
import re
from typing import Any

import jsonschema
import pytest

from mmserve.structured_output import RelaxedKeyword, SchemaError
from mmserve.structured_output.keywords import OUTLINES_RULES, XGRAMMAR_RULES
from mmserve.structured_output.normalize import Normalizer
from mmserve.structured_output.numbers import bounds_regex
from mmserve.structured_output.patterns import OPEN_END, full_match, json_text_pattern, with_length
from mmserve.structured_output.prepare import prepare_schema
from mmserve.structured_output.rewrites import simplify
from mmserve.structured_output.schema_tree import Problems, to_json

INT = {"type": "integer"}


def xgrammar(schema: Any, relaxed: bool = False) -> Any:
    return prepare_schema(schema, XGRAMMAR_RULES, relaxed).schema


def normalized(schema: Any) -> Any:
    """Normalized and rewritten, before the backend's check (which narrows to what the
    engines write: e.g. a property that may not appear is left undeclared)."""
    normalizer = Normalizer(schema, Problems(relaxed=False))
    root, defs = simplify(*normalizer.run(), normalizer.merger)
    return to_json(root, defs)


def test_all_of_and_ref_siblings_merge_into_one_schema() -> None:
    base = {"type": "object", "properties": {"a": INT}, "required": ["a"]}
    schema = {
        "definitions": {"base": base},
        "allOf": [{"$ref": "#/definitions/base"}, {"properties": {"b": {"type": "string"}}}],
    }
    assert xgrammar(schema) == {
        "type": ["object"], "properties": {"a": {"type": ["integer"]}, "b": {"type": ["string"]}},
        "required": ["a"],
    }  # fmt: skip
    assert xgrammar({"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 3}) == {
        "type": ["string"], "maxLength": 3,
    }  # fmt: skip


def test_combinator_siblings_go_into_the_branches() -> None:
    schema = {"type": "string", "anyOf": [{"minLength": 2}, {"maxLength": 0}]}
    assert xgrammar(schema) == {
        "anyOf": [{"type": ["string"], "minLength": 2}, {"type": ["string"], "maxLength": 0}]
    }
    # a branch the siblings rule out goes
    assert xgrammar({"type": "integer", "anyOf": [INT, {"type": "string"}]}) == {"type": ["integer"]}


def test_an_additional_properties_false_side_keeps_the_other_sides_names_out() -> None:
    closed = {"type": "object", "properties": {"a": INT}, "additionalProperties": False}
    merged = xgrammar({"allOf": [closed, {"properties": {"b": INT}}]})
    assert merged["properties"] == {"a": {"type": ["integer"]}}  # b is never written
    with pytest.raises(SchemaError, match="accepts no value"):  # b required, and ruled out
        xgrammar({"allOf": [closed, {"properties": {"b": INT}, "required": ["b"]}]})


def test_old_spellings() -> None:
    assert xgrammar({"type": "integer", "maximum": 5, "exclusiveMaximum": True}) == {
        "type": ["integer"], "maximum": 4,
    }  # fmt: skip
    assert xgrammar({"type": "array", "items": [INT], "additionalItems": False}) == {
        "type": ["array"], "prefixItems": [{"type": ["integer"]}], "items": False,
    }  # fmt: skip
    assert xgrammar({"type": "number", "divisibleBy": 3}) == {"type": ["integer"], "multipleOf": 3}


def test_annotations_unknown_keywords_and_formats_are_dropped() -> None:
    schema = {
        "type": "object", "title": "T", "self": {"vendor": "v"}, "_format": "x", "x-a": 1,
        "additonalProperties": False, "properties": {"d": {"type": "string", "format": "int32"}},
    }  # fmt: skip
    assert xgrammar(schema) == {"type": ["object"], "properties": {"d": {"type": ["string"]}}}


def test_untyped_nodes_are_narrowed_to_what_their_keywords_constrain() -> None:
    assert xgrammar({"minLength": 1}) == {"type": ["string"], "minLength": 1}
    assert xgrammar({"properties": {}, "minItems": 1}) == {
        "type": ["array", "object"], "properties": {}, "minItems": 1,
    }  # fmt: skip
    assert xgrammar({"multipleOf": 2}) == {"type": ["integer"], "multipleOf": 2}
    assert xgrammar({"type": "array", "properties": {"a": INT}}) == {"type": ["array"]}


def test_enum_values_are_filtered_by_their_siblings() -> None:
    assert xgrammar({"type": "integer", "minimum": 3, "enum": [1, 5, "x"]}) == {"enum": [5]}
    assert xgrammar({"enum": ["ab", "abc"], "maxLength": 2, "not": {"const": "x"}}) == {"enum": ["ab"]}
    unique = {"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True, "minItems": 1}
    assert normalized(unique) == {"enum": [["a"], ["b"], ["a", "b"]]}


def test_formats_become_exact_patterns_where_the_engine_is_loose() -> None:
    out = xgrammar({"type": "string", "format": "date"})
    assert "format" not in out and re.fullmatch(out["pattern"], "2024-02-29")
    assert not re.fullmatch(out["pattern"], "2023-02-29")
    assert xgrammar({"type": "string", "format": "uuid"})["format"] == "uuid"  # xgrammar's own


def test_references_resolve_against_a_nested_id() -> None:
    schema = {
        "$schema": "http://json-schema.org/draft-04/schema#", "id": "http://x/root.json",
        "properties": {"a": {
            "id": "http://x/other.json", "definitions": {"d": INT},
            "properties": {"b": {"$ref": "#/definitions/d"}},
        }},
        "definitions": {"d": {"type": "string"}},
    }  # fmt: skip
    out = xgrammar(schema)
    assert out["properties"]["a"]["properties"]["b"] == {"$ref": "#/$defs/d"}
    assert out["$defs"]["d"] == {"type": ["integer"]}
    jsonschema.Draft4Validator(schema).validate({"a": {"b": 1}})  # what the validator reads


def test_relaxed_drops_and_reports_what_it_cannot_enforce() -> None:
    schema = {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "object"}, "uniqueItems": True},
            "shape": {"oneOf": [{"type": "number"}, {"type": "integer", "minimum": 1}]},
        },
        "if": {"required": ["tags"]}, "then": {"required": ["shape"]},
    }  # fmt: skip
    with pytest.raises(SchemaError, match="at /if: keyword 'if'"):
        prepare_schema(schema, XGRAMMAR_RULES)
    prepared = prepare_schema(schema, XGRAMMAR_RULES, relaxed=True)
    assert set(prepared.relaxed) == {
        RelaxedKeyword("/properties/tags", "uniqueItems"),
        RelaxedKeyword("/properties/shape", "oneOf"),  # compiled as anyOf
        RelaxedKeyword("", "if"),  # "then" goes with it
    }
    assert "anyOf" in prepared.schema["properties"]["shape"]
    assert prepare_schema({"type": "string"}, XGRAMMAR_RULES, relaxed=True).relaxed == ()
    many = {"type": "object", "dependencies": {f"a{i}": ["b"] for i in range(7)}}  # 2**7 ways
    assert prepare_schema(many, XGRAMMAR_RULES, relaxed=True).relaxed == (
        RelaxedKeyword("", "dependencies"),  # as the schema spells it
    )


@pytest.mark.parametrize(
    "branches",
    [
        [{"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
         {"type": "object", "properties": {"k": {"enum": ["b"]}}, "required": ["k"]}],
        [{"type": "object", "properties": {"a": INT}, "required": ["a"], "additionalProperties": False},
         {"type": "object", "properties": {"b": INT}, "required": ["b"], "additionalProperties": False}],
        [{"enum": ["always"]}, {"enum": ["avoid"]}],
        [INT, {"type": ["string", "null"]}],
    ],
)  # fmt: skip
def test_provably_disjoint_one_of_is_kept(branches: list[Any]) -> None:
    assert "oneOf" in xgrammar({"oneOf": branches})


def test_dependencies_one_of_required_and_not_are_written_exactly() -> None:
    """expand.py; each schema's own validator agrees with the rewritten one on objects."""
    schemas = [
        {"type": "object", "properties": {"a": INT, "b": INT}, "dependencies": {"a": ["b"]}},
        {"type": "object", "oneOf": [{"required": ["a"]}, {"required": ["b", "c"]}]},
        {"type": "object", "not": {"required": ["a", "b"]}},
    ]
    values = [{}, {"a": 1}, {"b": 1}, {"a": 1, "b": 1}, {"b": 1, "c": 1}, {"a": 1, "b": 1, "c": 1}]
    for schema in schemas:
        rewritten = jsonschema.Draft202012Validator(normalized(schema))
        original = jsonschema.Draft7Validator(schema)
        for value in values:
            assert rewritten.is_valid(value) == original.is_valid(value), (schema, value)


def test_patterns() -> None:
    assert full_match("^a$|^b$") == "a|b"
    # a search: an alternative without its anchor may be preceded / followed by more
    assert full_match("^(a$|b)") == f"(?:a|b{OPEN_END})"
    assert full_match("^https?://") == f"https?://{OPEN_END}"
    assert full_match("a|^b$") == f"{OPEN_END}a{OPEN_END}|b"
    assert full_match("a|^b$", search=False) == "a|b"
    assert with_length("^[a-z]+$", 2, 5) == "^[a-z]{2,5}$"
    assert with_length("^[A-Z][a-z]*$", 2, 5) == "^[A-Z][a-z]{1,4}$"
    assert with_length("^ab", 0, 5) == "^ab[ !#-\\[\\]-~]{0,3}$"  # the open end bounded
    assert with_length("^[a-z]+[0-9]+$", 2, 5) is None
    text = json_text_pattern('^a"|[^x]$')
    assert text.startswith("(?:") and '\\\\"' in text  # grouped; `"` as its escape


def test_huge_bounds_make_a_regex_linear_in_their_digits() -> None:
    """A float bound near 1e308 (309 digits): the ranges of a width are one class each; the
    recursion once split every range again, and took the test run past 18 GB."""
    regex = bounds_regex({"minimum": 0, "maximum": 1e308}, integer=True) or ""
    assert len(regex) < 100_000
    compiled = re.compile(regex)
    assert compiled.fullmatch("9" * 308) and compiled.fullmatch("1" + "0" * 308)
    assert not compiled.fullmatch("1" + "0" * 309) and not compiled.fullmatch("-1")
    rng = random.Random(0)
    for _ in range(300):
        lo = rng.randrange(10**7)
        hi = lo + rng.randrange(10**7)
        exact = re.compile(bounds_regex({"minimum": lo, "maximum": hi}, integer=True) or "")
        for n in (lo, hi, rng.randint(lo, hi), lo - 1, hi + 1):
            assert bool(exact.fullmatch(str(n))) == (lo <= n <= hi), (lo, hi, n)


def test_integer_bounds_regex_is_exact() -> None:
    regex = re.compile(bounds_regex({"minimum": -12, "exclusiveMaximum": 130}, integer=True) or "")
    inside = {str(n) for n in range(-12, 130)}
    assert all(regex.fullmatch(t) for t in inside)
    assert not any(regex.fullmatch(str(n)) for n in [*range(-40, -12), *range(130, 1200)])
    assert not regex.fullmatch("007")


def test_outlines_writes_references_out_and_spells_out_any_value() -> None:
    schema = {"$defs": {"p": INT}, "type": "object", "properties": {"a": {"$ref": "#/$defs/p"}, "b": {}}}
    out = prepare_schema(schema, OUTLINES_RULES).schema
    assert out["properties"]["a"] == {"type": ["integer"]}
    assert "anyOf" in out["properties"]["b"]  # outlines_schema.ANY


def test_a_schema_that_accepts_nothing_is_refused_as_such() -> None:
    """Every oneOf branch rules out a property the object requires (a real schema's)."""
    numbers = {n: {"type": "number"} for n in ("r", "w", "h")}
    dims = {
        "type": "object", "properties": numbers, "required": ["r", "w", "h"],
        "oneOf": [{"not": {"required": ["w", "h"]}, "required": ["r"]},
                  {"not": {"required": ["r"]}, "required": ["w", "h"]}],
    }  # fmt: skip
    schema = {"type": "object", "properties": {"dims": dims}, "required": ["dims"]}
    for rules in (XGRAMMAR_RULES, OUTLINES_RULES):
        with pytest.raises(SchemaError, match="at /: the schema accepts no value"):
            prepare_schema(schema, rules)
