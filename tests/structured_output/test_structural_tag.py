"""vLLM's structural_tag constraint (structural_tag.py) with xgrammar and SmolLM2's tokens: both
spellings compile one language; walked outputs hold JSON that validates (jsonschema) inside their
tags; the schemas inside are held to json_schema's rules, with pointers into the tag's JSON."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest

from mmserve.errors import InvalidArgument
from mmserve.structured_output import StructuredOutputParams
from mmserve.structured_output.params import MAX_STRUCTURAL_TAG_BYTES
from tests.structured_output.conftest import SMOLLM2_EOS, get_backend
from tests.structured_output.walk import Vocab, walk

pytest.importorskip("xgrammar")

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Z][a-z]+$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
# vLLM's first spelling, and xgrammar's of the same language
STRUCTURES = {
    "type": "structural_tag",
    "structures": [
        {"begin": f"<function={name}>", "schema": schema, "end": "</function>"}
        for name, schema in SCHEMAS.items()
    ],
    "triggers": ["<function="],
}


def triggered(**options: Any) -> dict[str, Any]:
    tags = [
        {"type": "tag", "begin": f"<function={name}>",
         "content": {"type": "json_schema", "json_schema": schema}, "end": "</function>"}
        for name, schema in SCHEMAS.items()
    ]  # fmt: skip
    fmt = {"type": "triggered_tags", "triggers": ["<function="], "tags": tags, **options}
    return {"type": "structural_tag", "format": fmt}


CALL = re.compile(r"<function=(\w+)>(.*?)</function>", re.DOTALL)


def compile_tag(tokenizer: Any, tag: Any, relaxed: bool = False) -> Any:
    text = tag if isinstance(tag, str) else json.dumps(tag)
    return get_backend(tokenizer, "xgrammar").compile(
        StructuredOutputParams("structural_tag", text, relaxed=relaxed)
    )


def accepts(compiled: Any, tokenizer: Any, text: str) -> bool:
    matcher = compiled.matcher()
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept_token(t) for t in tokens) and matcher.accept_token(SMOLLM2_EOS[0])


def check_calls(text: str) -> int:
    """Every tagged call in text names a tool and holds JSON of its schema; how many."""
    calls = CALL.findall(text)
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    return len(calls)


CASES = [
    ('Let me look. <function=get_weather>{"city": "Paris", "days": 2}</function> Done.', True),
    ("No call at all, just text.", True),
    (('<function=get_weather>{"city": "Oslo", "unit": "celsius", "days": 7}</function>'
      '<function=get_time>{"zone": "Europe/Oslo"}</function>'), True),
    ('<function=get_weather>{"city": "Oslo", "days": 8}</function>', False),  # maximum
    ('<function=get_weather>{"city": "Oslo"}</function>', False),  # required
    ('<function=get_weather>{"city": "Oslo", "days": 1, "x": 1}</function>', False),
    ('<function=get_weather>{"city": "Amsterdam-Noord", "days": 1}</function>', False),  # maxLength
    ('<function=get_time>{"zone": "europe/oslo"}</function>', False),  # pattern
    ('<function=get_weather>{"city": "Oslo", "days": 1}', False),  # no end
    ('<function=get_news>{}</function>', False),  # a trigger, then no tag's begin
    ('<function=get_weather>{"city": "O\x01slo", "days": 1}</function>', False),  # raw control
    ('<function=get_weather>{' + " " * 40 + '"city": "Oslo", "days": 1}</function>', False),
    ('<function=get_weather>{   "city": "Oslo", "days": 1}</function>', True),
]  # fmt: skip


@pytest.mark.parametrize("form", ["structures", "format"])
def test_both_forms_accept_and_refuse_as_the_schemas_say(tokenizer: Any, form: str) -> None:
    """Free text around the calls; inside a tag, only JSON its schema validates (within
    json_schema's bound on whitespace, and no raw control character in a length-bounded string,
    which xgrammar's own class for them would let in)."""
    compiled = compile_tag(tokenizer, STRUCTURES if form == "structures" else triggered())
    for text, ok in CASES:
        if ok:
            check_calls(text)  # (the expectation itself validates)
        assert accepts(compiled, tokenizer, text) is ok, text


def test_walks_write_calls_that_validate(tokenizer: Any, vocab: Vocab) -> None:
    """Random walks through the grammar (SmolLM2's tokens): after a prefix that opens a call,
    and from nothing with at_least_one and stop_after_first (exactly one call, then the end)."""
    opened = compile_tag(tokenizer, STRUCTURES)
    once = compile_tag(tokenizer, triggered(at_least_one=True, stop_after_first=True))
    prefix = "Checking. <function=get_weather>"
    for seed in range(6):
        matcher = opened.matcher()
        head = tokenizer.encode(prefix, add_special_tokens=False)
        assert all(matcher.accept_token(t) for t in head)
        text = prefix + vocab.text(walk(matcher, vocab, seed, soft_len=20))
        assert check_calls(text) >= 1, text
        text = vocab.text(walk(once.matcher(), vocab, seed, soft_len=20))
        assert check_calls(text) == 1 and text.endswith("</function>"), text


def test_other_formats_pass_through_to_xgrammar(tokenizer: Any) -> None:
    """A sequence of a constant, a regex and a tag whose content is a grammar; a format's own
    max_whitespace_cnt is kept."""
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "Answer: "},
        {"type": "regex", "pattern": "[0-9]{2}"},
        {"type": "tag", "begin": " <n>", "content": {"type": "grammar", "grammar": 'root ::= "x"+'},
         "end": "</n>"},
    ]}}  # fmt: skip
    compiled = compile_tag(tokenizer, tag)
    assert accepts(compiled, tokenizer, "Answer: 42 <n>xxx</n>")
    assert not accepts(compiled, tokenizer, "Answer: 4 <n>x</n>")
    assert not accepts(compiled, tokenizer, "Answer: 42 <n>y</n>")
    tight = triggered()
    tight["format"]["tags"][0]["content"]["max_whitespace_cnt"] = 1
    compiled = compile_tag(tokenizer, tight)
    assert accepts(compiled, tokenizer, '<function=get_weather>{ "city":"Oslo","days":1}</function>')
    assert not accepts(compiled, tokenizer, '<function=get_weather>{  "city":"Oslo","days":1}</function>')


BAD_SCHEMA = {"type": "object", "properties": {"x": {"type": "integer", "not": {"const": 3}}}}


def test_schema_keywords_are_refused_or_relaxed_by_pointer_into_the_tag(tokenizer: Any) -> None:
    legacy = {"structures": [{"begin": "<f>", "schema": BAD_SCHEMA, "end": "</f>"}], "triggers": ["<f"]}
    fmt = triggered()
    fmt["format"]["tags"][1]["content"]["json_schema"] = BAD_SCHEMA
    # types left out, as vLLM's tests write them (xgrammar infers them from the members)
    untyped = {"format": {"type": "triggered_tags", "triggers": ["<f"],
                          "tags": [{"begin": "<f>", "content": {"json_schema": BAD_SCHEMA}, "end": "</f>"}]}}  # fmt: skip
    for tag, at in ((legacy, "/structures/0/schema"), (fmt, "/format/tags/1/content/json_schema"),
                    (untyped, "/format/tags/0/content/json_schema")):  # fmt: skip
        with pytest.raises(InvalidArgument) as e:
            compile_tag(tokenizer, tag)
        assert e.value.field == "structured.structural_tag"
        assert e.value.message.startswith(f"at {at}/properties/x/not: keyword 'not'")
        compiled = compile_tag(tokenizer, tag, relaxed=True)
        assert [(k.pointer, k.keyword) for k in compiled.relaxed] == [(f"{at}/properties/x", "not")]


@pytest.mark.parametrize(
    "tag, expected",
    [
        ("{not json", "at /: not valid JSON"),
        ("[1]", "must be a JSON object"),
        ({"type": "json_schema", "format": {"type": "any_text"}}, "at /type: must be"),
        ({"type": "structural_tag"}, 'needs "format"'),
        ({"structures": [], "triggers": ["<"]}, "at /structures: must be a non-empty list"),
        ({"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}]}, "at /triggers"),
        ({"structures": [{"begin": "<a>", "end": "</a>"}], "triggers": ["<"]}, "at /structures/0:"),
        ({"structures": [{"begin": "", "schema": {}, "end": ""}], "triggers": ["<"]}, "/structures/0/begin"),
        ({"structures": [{"begin": "<a>", "schema": "{}", "end": "</a>"}], "triggers": ["<"]},
         "at /structures/0/schema: a schema must be"),
        ({"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}], "triggers": ["<b"]},
         "does not match any trigger"),
        ({"format": {"type": "no_such_format"}}, "not recognized"),
        ({"format": {"type": "regex", "pattern": "a(b"}}, ""),
        ({"format": {"type": "token", "token": "<|im_start|>"}}, "Invalid structural tag error: Token"),
        ("[" * 5000 + "]" * 5000, "nested too deeply"),
    ],
)  # fmt: skip
def test_bad_tags_are_refused_naming_the_field(tokenizer: Any, tag: Any, expected: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        compile_tag(tokenizer, tag)
    assert e.value.field == "structured.structural_tag"
    assert expected in e.value.message
    assert not any(leak in str(e.value) for leak in (".cc", "/home", "Traceback", "Check failed"))


def test_a_token_format_cannot_write_a_special_token(tokenizer: Any) -> None:
    """As under every constraint, a special token (SmolLM2's <|im_start|>, id 1) is never
    written, even named by id in a token format."""
    tag = {"format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "a"}, {"type": "token", "token": 1}]}}  # fmt: skip
    matcher = compile_tag(tokenizer, tag).matcher()
    assert all(matcher.accept_token(t) for t in tokenizer.encode("a", add_special_tokens=False))
    assert not matcher.accept_token(1)


def test_params_limits_cache_key_and_outlines() -> None:
    text = json.dumps(STRUCTURES)
    with pytest.raises(InvalidArgument, match="structured.structural_tag: must be a non-empty"):
        StructuredOutputParams("structural_tag", "").validate()
    with pytest.raises(InvalidArgument, match="longer than the limit"):
        StructuredOutputParams("structural_tag", " " * (MAX_STRUCTURAL_TAG_BYTES + 1)).validate()
    strict, relaxed = (StructuredOutputParams("structural_tag", text, relaxed=r) for r in (False, True))
    assert strict.cache_key != relaxed.cache_key


def test_outlines_refuses_structural_tags(tokenizer: Any) -> None:
    params = StructuredOutputParams("structural_tag", json.dumps(STRUCTURES), backend="outlines")
    with pytest.raises(InvalidArgument, match="structured.structural_tag: the outlines backend"):
        get_backend(tokenizer, "outlines").compile(params)
