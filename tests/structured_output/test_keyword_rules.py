"""The experiment behind keywords.py, re-run: every keyword and format a backend's rules
list is really enforced (a violating instance is refused, a valid one accepted), so an
engine upgrade that changes behaviour fails here instead of weakening schemas silently.
Also the engine quirks the backends work around, each still there (or the workaround can
go)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mmserve.structured_output import (
    CompiledGrammar,
    RelaxedKeyword,
    SchemaError,
    StructuredOutputParams,
)
from mmserve.structured_output.keywords import OUTLINES_RULES, XGRAMMAR_RULES, SchemaRules
from tests.structured_output.conftest import SMOLLM2_EOS, get_backend

INT = {"type": "integer"}


def in_object(schema: dict[str, Any], good: str, bad: str) -> tuple[dict[str, Any], str, str]:
    """(an object whose required "n" has `schema`, and the values as its "n")."""
    wrapped = {"type": "object", "properties": {"n": schema}, "required": ["n"]}
    return wrapped, f'{{"n":{good}}}', f'{{"n":{bad}}}'


# keyword -> (schema, valid instance, violating instance)
KEYWORD_CASES: dict[str, tuple[dict[str, Any], str, str]] = {
    "enum": ({"enum": ["a", 1]}, "1", '"b"'),
    "const": ({"const": {"a": 1}}, '{"a":1}', '{"a":2}'),
    "anyOf": ({"anyOf": [INT, {"type": "string"}]}, '"x"', "true"),
    "oneOf": ({"oneOf": [INT, {"type": "string"}]}, '"x"', "true"),
    "allOf": ({"allOf": [INT]}, "3", '"x"'),
    "$ref": ({"$defs": {"p": INT}, "$ref": "#/$defs/p"}, "1", '"x"'),
    # numbers inside an object: outlines-core's Index ends at the first accepting state of
    # the whole output, so a top-level "1" can never become "1.5"
    "minimum": in_object({"type": "number", "minimum": 2}, "2.5", "1.5"),
    "maximum": in_object({"type": "integer", "maximum": 3}, "3", "4"),
    "exclusiveMinimum": in_object({"type": "integer", "exclusiveMinimum": 3}, "4", "3"),
    "exclusiveMaximum": in_object({"type": "number", "exclusiveMaximum": 2}, "1.5", "2"),
    "multipleOf": in_object({"type": "integer", "multipleOf": 3}, "6", "4"),
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
    "date": ("2024-02-29", "2023-02-29"),
    "time": ("23:59:59Z", "23:59:60Z"),
    "date-time": ("2024-01-31T10:00:00+01:00", "2024-01-31T10:00:00"),
    "ipv4": ("10.0.0.1", "10.0.0.01"),
    "hostname": ("a.example.com", "-a.com"),
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
    for fmt in sorted(rules.formats | rules.pattern_formats):
        good, bad = FORMAT_CASES[fmt]
        out.append(
            (f"format={fmt}", {"type": "string", "format": fmt}, json.dumps(good), json.dumps(bad))
        )
    return out


def test_every_listed_keyword_and_format_has_a_case() -> None:
    for rules in RULES.values():
        assert rules.keywords <= KEYWORD_CASES.keys()
        assert rules.formats | rules.pattern_formats <= FORMAT_CASES.keys()


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


def test_xgrammar_optional_group_quirk(tokenizer: Any) -> None:
    """xgrammar 0.2.9 lets a schema pattern's optional group whose inside repeats match its
    tail alone (`(ab+)?` matches "b"); patterns.xgrammar_pattern writes `{0,1}` instead."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    raw = xgr.Grammar.from_json_schema(json.dumps({"type": "string", "pattern": "^(ab+)?$"}))
    assert _is_grammar_accept_string(raw, '"b"')  # the quirk
    backend = get_backend(tokenizer, "xgrammar")
    compiled = backend.compile(
        StructuredOutputParams("json_schema", json.dumps({"type": "string", "pattern": "^(ab+)?c$"}))
    )
    assert accepts(compiled, tokenizer, '"abbc"') and accepts(compiled, tokenizer, '"c"')
    assert not accepts(compiled, tokenizer, '"bc"')


OUTLINES_QUIRKS = [
    # outlines-core 0.2.14 put patterns in ungrouped: "normal|italic" took `"normal`
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "normal|italic"}},
      "required": ["a"]}, ['{"a": "normal"}', '{"a": "italic"}'], ['{"a": "normal}']),
    # it read "properties" before "type": an array became `{}`
    ({"type": "array", "properties": {}}, ["[]", '[1, "a"]'], ["{}"]),
    # an any-value property schema let a bare number through as the whole output
    ({"type": "object", "properties": {"a": {}}}, ['{"a": 5}', "{}"], ["5"]),
    ({"type": "object", "properties": {"a": {"type": "object", "additionalProperties": {}}}},
     ['{"a": {"x": 1}}'], ['{"a": {"x": 1}']),
    # numeric bounds were ignored (a top-level number is not tested: outlines-core's Index
    # ends at the first accepting state there, so "37" cannot follow "3")
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 90}},
      "required": ["n"]}, ['{"n": 0}', '{"n": 37}'], ['{"n": -1}', '{"n": 91}']),
]  # fmt: skip


@pytest.mark.parametrize(("schema", "good", "bad"), OUTLINES_QUIRKS)
def test_outlines_quirks_are_worked_around(
    tokenizer: Any, schema: Any, good: list[str], bad: list[str]
) -> None:
    compiled = get_backend(tokenizer, "outlines").compile(
        StructuredOutputParams("json_schema", json.dumps(schema))
    )
    assert all(accepts(compiled, tokenizer, text) for text in good), good
    assert not any(accepts(compiled, tokenizer, text) for text in bad), bad


@pytest.mark.parametrize("pattern", ['^a"b$', r"^a\\b$", r"^a\nb$", r"^[A-Z]:\\[a-z]+$"])
def test_xgrammar_patterns_it_would_write_unescaped_are_refused(tokenizer: Any, pattern: str) -> None:
    """xgrammar 0.2.9 writes a pattern's `"`, `\\` and control characters into the JSON text
    raw (`a"b` gave `"a"b"`, `a\\\\b` the escape `\\b`): refused, or relaxed; outlines escapes them."""
    schema = json.dumps({"type": "string", "pattern": pattern})
    xgrammar = get_backend(tokenizer, "xgrammar")
    with pytest.raises(SchemaError, match="at /pattern: .*unescaped"):
        xgrammar.compile(StructuredOutputParams("json_schema", schema))
    relaxed = xgrammar.compile(StructuredOutputParams("json_schema", schema, relaxed=True))
    assert relaxed.relaxed == (RelaxedKeyword("", "pattern"),)
    valid = json.dumps({'^a"b$': 'a"b', r"^a\\b$": "a\\b", r"^a\nb$": "a\nb"}.get(pattern, "C:\\ab"))
    outlines = get_backend(tokenizer, "outlines").compile(StructuredOutputParams("json_schema", schema))
    assert accepts(outlines, tokenizer, valid)


def test_xgrammar_format_beside_a_pattern_is_refused(tokenizer: Any) -> None:
    """xgrammar 0.2.9 enforces a format it knows and drops the pattern beside it."""
    schema = json.dumps({"type": "string", "format": "email", "pattern": "^a@x[.]com$"})
    backend = get_backend(tokenizer, "xgrammar")
    with pytest.raises(SchemaError, match="at /format"):
        backend.compile(StructuredOutputParams("json_schema", schema))
    relaxed = backend.compile(StructuredOutputParams("json_schema", schema, relaxed=True))
    assert relaxed.relaxed == (RelaxedKeyword("", "format"),)
    assert accepts(relaxed, tokenizer, '"a@x.com"')
    assert not accepts(relaxed, tokenizer, '"b@y.org"')


@pytest.mark.parametrize("name", sorted(RULES))
def test_unanchored_patterns_are_searches(name: str, tokenizer: Any) -> None:
    """JSON Schema's pattern is a search: `^https?://` takes whole URLs (not only the
    prefix, as a whole-string match would), `@x[.]com$` any local part; where length bounds
    cannot follow the open end, the pattern is narrowed to its whole-string matches."""
    backend = get_backend(tokenizer, name)

    def compiled(schema: dict[str, Any]) -> CompiledGrammar:
        return backend.compile(StructuredOutputParams("json_schema", json.dumps(schema)))

    url = compiled({"type": "string", "pattern": "^https?://"})
    assert accepts(url, tokenizer, '"https://example.com/a?b=1"')
    assert accepts(url, tokenizer, '"http://"')
    assert not accepts(url, tokenizer, '"ftp://example.com"')
    mail = compiled({"type": "string", "pattern": "@x[.]com$"})
    assert accepts(mail, tokenizer, '"jane.doe@x.com"')
    assert not accepts(mail, tokenizer, '"jane@x.org"')
    bounded = compiled({"type": "string", "pattern": "^ab", "maxLength": 4})
    assert accepts(bounded, tokenizer, '"abcd"')
    assert not accepts(bounded, tokenizer, '"abcde"')
