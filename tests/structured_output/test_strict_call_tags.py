"""Strict tools under tool_choice auto (frontend/tools.py strict_call_tags): a structural tag in
hermes' markup lets text be free but a call, once `<tool_call>` is out, only name an offered
tool and carry arguments a strict tool's schema validates. Checked with xgrammar and SmolLM2's
tokens against what the hermes parser reads from the same text and jsonschema (the request's
own accept hook), on strings and random walks; and where no tag may be added."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from mmserve.frontend.chat import read_tools
from mmserve.frontend.tools import ToolRequest, strict_call_tags, tool_spec
from mmserve.params import SamplingParams
from mmserve.processors.tool_parsers import get_parser
from mmserve.structured_output import StructuredOutputParams
from tests.structured_output.conftest import WEATHER_ARGUMENTS as WEATHER
from tests.structured_output.conftest import get_backend
from tests.structured_output.test_keyword_rules import accepts
from tests.structured_output.walk import Vocab, walk

pytest.importorskip("xgrammar")

TOOLS = (
    tool_spec("chat.tools[0]", "get_weather", json.dumps(WEATHER), strict=True),
    tool_spec("chat.tools[1]", "search", json.dumps({"type": "object", "properties": {"q": {"type": "string"}}})),
)  # fmt: skip
AUTO = ToolRequest(TOOLS, "auto")
HERMES = get_parser("hermes")


def call(name: str, arguments: Any) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def compiled(tokenizer: Any, request: ToolRequest = AUTO) -> Any:
    params = strict_call_tags(request, HERMES, tokenizer, "xgrammar")
    assert params is not None and params.kind == "structural_tag"
    return get_backend(tokenizer, "xgrammar").compile(params)


def test_what_the_tag_lets_through_is_what_the_parser_accepts(tokenizer: Any) -> None:
    grammar, accept = compiled(tokenizer), AUTO.accept()
    good = "Let me check. " + call("get_weather", {"city": "Oslo", "days": 3}) + " Done."
    content, calls = HERMES.parse(good, accept)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo", "days": 3})]
    assert "<tool_call>" not in content
    for text, ok in [
        (good, True),
        ("No call needed: it is sunny.", True),
        (call("search", {"q": "x", "anything": [1, {"b": None}]}), True),  # not strict: any object
        (call("get_weather", {"city": "Oslo", "days": 3}) + call("search", {}), True),
        (call("get_weather", {"city": "Oslo", "days": 9}), False),  # maximum
        (call("get_weather", {"city": "Oslo"}), False),  # required
        (call("get_weather", {"city": "Oslo", "days": 1, "x": 0}), False),
        (call("launch", {"target": "moon"}), False),  # not an offered tool
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}', False),  # no end
    ]:
        assert accepts(grammar, tokenizer, text) is ok, text
        if ok:  # what the grammar lets through, the parser reads as calls the request accepts
            _, calls = HERMES.parse(text, accept)
            assert len(calls) == text.count("<tool_call>")


def test_walks_write_only_calls_the_request_accepts(tokenizer: Any, vocab: Vocab) -> None:
    grammar, accept = compiled(tokenizer), AUTO.accept()
    prefix = 'Checking. <tool_call>\n{"name": "get_weather", "arguments": '
    head = tokenizer.encode(prefix, add_special_tokens=False)
    for seed in range(6):
        matcher = grammar.matcher()
        assert all(matcher.accept_token(t) for t in head)
        text = prefix + vocab.text(walk(matcher, vocab, seed, soft_len=20))
        _, calls = HERMES.parse(text, accept)
        assert calls and calls[0].name == "get_weather", text


def test_a_strict_schema_xgrammar_cannot_enforce_is_left_to_the_check_after(tokenizer: Any) -> None:
    odd = {"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}, "required": ["n"]}
    request = ToolRequest((tool_spec("chat.tools[0]", "f", json.dumps(odd), strict=True),), "auto")
    grammar = compiled(tokenizer, request)
    text = call("f", {"n": 3})
    assert accepts(grammar, tokenizer, text)  # any object gets through the grammar ...
    assert HERMES.parse(text, request.accept())[1] == []  # ... and the check keeps it as content


@dataclass
class _SpecialTagTokenizer:
    """A tokenizer whose `<tool_call>` is a special token (no constraint writes those)."""

    all_special_ids: list[int] = field(default_factory=lambda: [7])
    added_tokens_decoder: dict[int, Any] = field(default_factory=dict)
    added_tokens_encoder: dict[str, int] = field(default_factory=lambda: {"<tool_call>": 7})


def test_no_tag_where_it_cannot_apply(tokenizer: Any) -> None:
    loose = ToolRequest((TOOLS[1],), "auto")
    assert strict_call_tags(loose, HERMES, tokenizer, "xgrammar") is None  # no strict tool
    assert strict_call_tags(ToolRequest(TOOLS, "required"), HERMES, tokenizer, "xgrammar") is None
    assert strict_call_tags(AUTO, HERMES, tokenizer, "outlines") is None
    for name in ("mistral", "llama3_json", "pythonic"):  # no marker written as text to trigger on
        assert strict_call_tags(AUTO, get_parser(name), tokenizer, "xgrammar") is None
    assert strict_call_tags(AUTO, HERMES, _SpecialTagTokenizer(), "xgrammar") is None


def test_read_tools_adds_it_under_auto_unless_the_request_has_a_constraint(tokenizer: Any) -> None:
    params = SamplingParams()
    read_tools(AUTO, tokenizer, "LlamaForCausalLM", [1, 2], params, "xgrammar", "hermes")
    assert params.structured is not None and params.structured.kind == "structural_tag"
    own = StructuredOutputParams("regex", "[a-z]+")
    params = SamplingParams(structured=own)
    read_tools(AUTO, tokenizer, "LlamaForCausalLM", [1, 2], params, "xgrammar", "hermes")
    assert params.structured is own
