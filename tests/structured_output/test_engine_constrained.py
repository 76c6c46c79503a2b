"""Constrained generation through the engine: SmolLM2 (which would not write valid JSON by
itself) under varied schemas, regexes, choices and a grammar; every output validates."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from mmserve import LLM, SamplingParams
from mmserve.errors import InvalidArgument
from mmserve.structured_output import StructuredOutputParams
from tests.utils.tiny_models import smollm2_gguf_path

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
        },
        "required": ["name", "age", "email"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "city": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                                      "country": {"enum": ["FR", "DE", "IT"]}},
                     "required": ["name", "country"], "additionalProperties": False},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
            "score": {"type": "number", "minimum": -1, "maximum": 1},
        },
        "required": ["city", "tags", "score"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def llm() -> LLM:
    path = smollm2_gguf_path()
    assert path is not None
    return LLM(str(path), num_kv_blocks=256)


def chat(llm: LLM, text: str, structured: StructuredOutputParams, **kw: object) -> list[str]:
    # room for the whitespace a sampled SmolLM2 puts between JSON tokens (up to
    # JSON_MAX_WHITESPACE per gap): 100 was enough for one seed's noise and not another's
    params = SamplingParams(max_tokens=256, temperature=0.8, seed=1, structured=structured, **kw)  # type: ignore[arg-type]
    out = llm.chat([{"role": "user", "content": text}], params, use_tqdm=False)[0]
    assert all(o.finish_reason == "stop" for o in out.outputs), [o.text for o in out.outputs]
    return [o.text for o in out.outputs]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate(llm: LLM, name: str) -> None:
    schema = SCHEMAS[name]
    for text in chat(llm, "Describe something.", StructuredOutputParams("json_schema", json.dumps(schema))):
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.slow
def test_regex_choice_and_grammar(llm: LLM) -> None:
    pattern = r"[A-Z][a-z]{2,6} (is|was) [0-9]{1,3}"
    for text in chat(llm, "Say something.", StructuredOutputParams("regex", pattern)):
        assert re.fullmatch(pattern, text), text
    choices = ["Paris", "Berlin", "Rome"]
    for text in chat(llm, "Capital of France?", StructuredOutputParams("choice", choices)):
        assert text in choices
    grammar = 'root ::= "(" expr ")"\nexpr ::= [0-9]+ (("+" | "*") [0-9]+)*'
    for text in chat(llm, "Some arithmetic.", StructuredOutputParams("grammar", grammar)):
        assert re.fullmatch(r"\(\d+([+*]\d+)*\)", text), text


@pytest.mark.slow
def test_bad_schema_is_invalid_argument_and_engine_goes_on(llm: LLM) -> None:
    bad = {"type": "array", "uniqueItems": True, "items": {"type": "integer"}}
    with pytest.raises(InvalidArgument, match="uniqueItems"):
        chat(llm, "x", StructuredOutputParams("json_schema", json.dumps(bad)))
    assert not llm.frontend.has_unfinished
    assert chat(llm, "Capital of France?", StructuredOutputParams("choice", ["Paris", "Rome"]))
