"""An enum's or const's object and array values take the whitespace the grammar allows
elsewhere (xgrammar 0.2.9 wrote them as fixed compact text, cutting off a model that
pretty-prints): texts are judged by json.loads and jsonschema, tokenised by SmolLM2."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from mmserve.structured_output import StructuredOutputParams
from mmserve.structured_output.keywords import XGRAMMAR_RULES
from mmserve.structured_output.literals import MAX_NODES
from mmserve.structured_output.prepare import prepare_schema
from tests.structured_output.conftest import get_backend
from tests.structured_output.test_keyword_rules import accepts
from tests.structured_output.walk import Vocab, walk

NESTED = {"a": 1, "b": [1, 2], "c": {"d": None, "e": ["x", {"f": True}]}, "g h": []}
SCHEMAS: dict[str, dict[str, Any]] = {
    "const_object": {"const": {"a": 1, "b": [1, 2]}},
    "const_nested": {"const": NESTED},
    "const_empty": {"type": "object", "properties": {"o": {"const": {}}, "l": {"const": []}},
                    "required": ["o", "l"]},
    "enum_mixed": {"enum": [{"x": 1}, [1, 2], "s", 3, None, [1, 2], {"x": 1}, [[1], [2, [3]]]]},
    "enum_prefixes": {"enum": [[1], [1, 2], [1, 2, 3], {"a": 1}, {"a": 1, "b": 2}]},
    "in_property": {"type": "object", "properties": {"p": {"enum": [{"k": "v"}, [True]]}},
                    "required": ["p"], "additionalProperties": False},
    "in_defs": {"$defs": {"c": {"const": [{"a": 1}, {"b": [2]}]}}, "type": "array",
                "items": {"$ref": "#/$defs/c"}, "minItems": 1, "maxItems": 2},
    "one_of_consts": {"oneOf": [{"const": {"t": 1}}, {"const": {"t": 2}}]},
    "escaped_keys": {"const": {'q"\\': 1, "é\n": [2]}},  # outlines refuses such keys
}  # fmt: skip


def instances(schema: dict[str, Any]) -> list[Any]:
    """Valid instances, from the enum and const values in the schema."""
    if "const" in schema:
        return [schema["const"]]
    if "enum" in schema:
        return schema["enum"]
    if "oneOf" in schema:
        return [b["const"] for b in schema["oneOf"]]
    if "$defs" in schema:
        return [[schema["$defs"]["c"]["const"]] * 2]
    props = schema["properties"]
    return [{name: v for name, sub in props.items() for v in instances(sub)[:1]}]


def broken(value: Any) -> list[Any]:
    """Values one change away from `value` (at every level)."""
    out: list[Any] = []
    if isinstance(value, dict):
        out += [{**value, "extra": 0}, "x"]
        out += [{k: v for k, v in value.items() if k != name} for name in value]
        out += [{**value, name: b} for name, v in value.items() for b in broken(v)]
    elif isinstance(value, list):
        out += [[*value, 0], value[:-1], {}]
        out += [value[:i] + [b] + value[i + 1 :] for i, v in enumerate(value) for b in broken(v)]
    else:
        out += [[value], "other" if value != "other" else 0]
    return out


def compiled(tokenizer: Any, backend: str, schema: dict[str, Any]) -> Any:
    params = StructuredOutputParams("json_schema", json.dumps(schema), backend=backend)
    return get_backend(tokenizer, backend).compile(params)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_pretty_printed_values_are_accepted(tokenizer: Any, name: str) -> None:
    schema = SCHEMAS[name]
    grammar = compiled(tokenizer, "xgrammar", schema)
    for value in instances(schema):
        for indent, separators in ((2, None), ("\t", None), (None, None), (None, (",", ":"))):
            # a non-ASCII character as itself: the engines write no \u escapes in values
            text = json.dumps(value, indent=indent, separators=separators, ensure_ascii=False)
            jsonschema.validate(json.loads(text), schema)  # the reference
            assert accepts(grammar, tokenizer, text), text


@pytest.mark.parametrize(
    ("backend", "name"),
    [("xgrammar", name) for name in sorted(SCHEMAS)]
    + [("outlines", name) for name in sorted(SCHEMAS) if name != "escaped_keys"],
)
def test_values_one_change_away_are_refused(tokenizer: Any, backend: str, name: str) -> None:
    schema = SCHEMAS[name]
    grammar = compiled(tokenizer, backend, schema)
    validator = jsonschema.Draft202012Validator(schema)
    for value in instances(schema):
        # outlines allows one space between tokens
        assert accepts(grammar, tokenizer, json.dumps(value, ensure_ascii=False)), value
        for bad in broken(value):
            if not validator.is_valid(bad):
                for indent in (2, None):
                    text = json.dumps(bad, indent=indent, ensure_ascii=False)
                    assert not accepts(grammar, tokenizer, text), text


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_walks_validate(tokenizer: Any, vocab: Vocab, name: str) -> None:
    schema = SCHEMAS[name]
    grammar = compiled(tokenizer, "xgrammar", schema)
    for seed in range(4):
        text = vocab.text(walk(grammar.matcher(), vocab, seed))
        jsonschema.validate(json.loads(text), schema)


def test_scalar_enums_stay_as_written() -> None:
    schema = {"type": "object", "properties": {
        "s": {"const": "x"}, "n": {"enum": [1, 2.5, None, True, "a"]}}, "required": ["s", "n"]}  # fmt: skip
    prepared = prepare_schema(schema, XGRAMMAR_RULES).schema
    assert prepared["properties"] == {"s": {"enum": ["x"]}, "n": {"enum": [1, 2.5, None, True, "a"]}}


def test_values_past_the_budget_stay_exact(tokenizer: Any) -> None:
    value = [{"k": i} for i in range(MAX_NODES)]  # twice the budget: written as text
    grammar = compiled(tokenizer, "xgrammar", {"enum": [value, [1, 2]]})
    assert accepts(grammar, tokenizer, json.dumps(value, separators=(",", ":")))
    assert accepts(grammar, tokenizer, "[1,\n 2]")
    assert not accepts(grammar, tokenizer, json.dumps(value[:-1], separators=(",", ":")))


def test_xgrammar_compact_literal_quirk() -> None:
    """xgrammar 0.2.9 writes an enum's object as fixed compact text (literals.py spells it
    out as a schema); when this fails, the workaround can go."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    raw = xgr.Grammar.from_json_schema(json.dumps({"const": {"a": 1}}), any_whitespace=True)
    assert _is_grammar_accept_string(raw, '{"a":1}')
    assert not _is_grammar_accept_string(raw, '{"a": 1}')  # the quirk
