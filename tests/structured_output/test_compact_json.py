"""disable_any_whitespace (vLLM's option): JSON with no whitespace but one space after each ","
and ":", checked on random walks (jsonschema validates them; outside strings every separator has
its one space and no other whitespace is left) and on strings; outlines refuses it and "auto"
takes xgrammar for it."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Any

import jsonschema
import pytest

from mmserve.errors import InvalidArgument
from mmserve.structured_output import StructuredOutputParams
from tests.structured_output.conftest import PADDED_VOCAB, SMOLLM2_EOS, get_backend
from tests.structured_output.test_keyword_rules import accepts
from tests.structured_output.test_structured_generation import FORMATS, SCHEMAS, SEEDS, generate
from tests.structured_output.walk import Vocab

pytest.importorskip("xgrammar")

_STRING = re.compile(r'"(?:\\.|[^"\\])*"')


def compact_form(text: str) -> bool:
    """Outside its strings, each "," and ":" is followed by one space and nothing else is
    whitespace."""
    rest = _STRING.sub('""', text)
    return (
        rest.count(", ") == rest.count(",")
        and rest.count(": ") == rest.count(":")
        and not re.search(r"\s", rest.replace(", ", ",").replace(": ", ":"))
    )


def compact(kind: str, value: str = "") -> StructuredOutputParams:
    return StructuredOutputParams(kind, value, disable_any_whitespace=True)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_walks_are_compact_and_validate(name: str, tokenizer: Any, vocab: Vocab) -> None:
    schema = SCHEMAS[name][0]
    backend = get_backend(tokenizer, "xgrammar")
    for seed in SEEDS:
        text = generate(backend, compact("json_schema", json.dumps(schema)), vocab, tokenizer, seed)
        jsonschema.validate(json.loads(text), schema, format_checker=FORMATS)
        assert compact_form(text), text
    text = generate(backend, compact("json_object"), vocab, tokenizer, 0)
    assert isinstance(json.loads(text), dict) and compact_form(text), text


def test_only_the_separators_space_is_allowed(tokenizer: Any) -> None:
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}},
                         "required": ["a"], "additionalProperties": False})  # fmt: skip
    backend = get_backend(tokenizer, "xgrammar")
    tight, loose = backend.compile(compact("json_schema", schema)), backend.compile(
        StructuredOutputParams("json_schema", schema)
    )
    for text, compact_ok in [
        ('{"a": [1, 2]}', True),
        ('{"a": [ 1, 2]}', False),
        ('{"a":[1,2]}', False),
        ('{ "a": [1, 2] }', False),
        ('{"a": [1,\n 2]}', False),
        ('{"a": ["x y"]}', False),  # (not an integer: refused either way)
    ]:
        assert accepts(tight, tokenizer, text) is compact_ok, text
        assert accepts(loose, tokenizer, text) is (text != '{"a": ["x y"]}'), text
    # a string's own spaces are its content, not whitespace
    strings = backend.compile(compact("json_schema", '{"type": "array", "items": {"type": "string"}}'))
    assert accepts(strings, tokenizer, '["a b", "c : d, e"]')


def test_other_kinds_ignore_it_and_the_cache_tells_it_apart() -> None:
    schema = StructuredOutputParams("json_schema", "{}")
    assert compact("json_schema", "{}").cache_key != schema.cache_key
    assert compact("regex", "a+").cache_key == StructuredOutputParams("regex", "a+").cache_key
    assert not compact("regex", "a+").compact and compact("json_object").compact


def test_outlines_refuses_it_and_auto_takes_xgrammar(tokenizer: Any) -> None:
    from mmserve.structured_output import StructuredOutputManager

    params = compact("json_schema", '{"type": "integer"}')
    with pytest.raises(InvalidArgument, match="structured.disable_any_whitespace: the outlines"):
        get_backend(tokenizer, "outlines").compile(replace(params, backend="outlines"))
    manager = StructuredOutputManager(tokenizer, PADDED_VOCAB, SMOLLM2_EOS, default_backend="outlines")
    assert manager.compile(params) is manager.compile(replace(params, backend="xgrammar"))
    # without it, auto stays with the default
    plain = StructuredOutputParams("json_schema", '{"type": "integer"}')
    assert manager.compile(plain) is manager.compile(replace(plain, backend="outlines"))
    manager.close()
